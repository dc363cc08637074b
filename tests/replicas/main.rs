//! Replicas that agree: two ray-xds replicas through a progressive shift, peers that
//! lie, skew, echo, flood or hang, and every replica restarted at once.

mod agree;
mod hostile;
mod prestop;
mod restart;
