//! The weight schedule: the target's percent of traffic at a given time, atomic or
//! progressive.
//!
//! Progressive steps count from the earliest start of the same shift (same serving
//! cluster, same target) that this replica or a peer saw; a peer's start is taken only
//! if no earlier than [`PEER_LAG`] before this replica saw the switch begin, when it
//! did. So replicas fed the same state step together, and a restarted one resumes
//! where its peers are. The step is never past the schedule's last, and the target's
//! percent never above 100.

use std::time::{Duration, SystemTime};

use super::state::ServiceSwitch;
use super::Switchover;
use crate::policy::switchover::{ShiftMode, SwitchoverPolicy};

/// How much earlier than this replica another may have seen a switch begin (its source
/// watch, dashboard polls and probes run on their own timers).
pub const PEER_LAG: Duration = Duration::from_secs(30);

impl Switchover {
    /// The target's percent of traffic now: all of it at once (atomic, a dead serving
    /// cluster, or a peer that has moved already), or the progressive schedule's step,
    /// counted from the earliest start of the same shift this replica or a peer saw.
    pub(super) fn shift_weight(
        &self,
        st: &mut ServiceSwitch,
        key: &str,
        target: &str,
        policy: &SwitchoverPolicy,
        desperate: bool,
        now: SystemTime,
    ) -> u32 {
        match policy.shift() {
            ShiftMode::Atomic => 100,
            _ if desperate => 100,
            // A peer has moved already: so do we (our own gates passed).
            _ if self.peers.completed(key, target) => 100,
            ShiftMode::Progressive { steps, interval } => {
                let mut started = *st.shift_started.get_or_insert(now);
                // No earlier than this replica saw the switch begin (less the lag
                // between replicas), when it did.
                let floor = st
                    .target_since
                    .filter(|_| st.saw_begin)
                    .map(|t| t - PEER_LAG);
                if let Some(peer) = self
                    .peers
                    .shift_started(key, &st.serving, target)
                    .filter(|p| floor.is_none_or(|f| *p >= f))
                {
                    started = started.min(peer);
                }
                st.shift_started = Some(started);
                let elapsed = now.duration_since(started).unwrap_or_default();
                let intervals = elapsed.as_nanos() / interval.as_nanos().max(1);
                st.step = usize::try_from(intervals)
                    .unwrap_or(usize::MAX)
                    .saturating_add(1)
                    .min(steps.len());
                if st.step < steps.len() {
                    st.step_due = Some(started + interval * st.step as u32);
                }
                steps.get(st.step - 1).copied().unwrap_or(100).min(100)
            }
        }
    }
}
