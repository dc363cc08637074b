//! Replicas that agree: two ray-xds replicas through a progressive shift, and peers that
//! lie, skew, echo, flood or hang.

mod agree;
mod hostile;
