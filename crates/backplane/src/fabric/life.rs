//! Node life cycle: EMPTY → BOOTING → READY → DOWN (→ BOOTING → READY …), sans-IO.
//!
//! The supervisor feeds it what it observed (agent spawned, agent said hello, agent exited,
//! heartbeat value at a tick) with the current time, and applies the transitions it returns to
//! the node table. Generation is bumped on every entry into READY, so work stamped with an
//! older generation is recognised as stale.
#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use crate::wire::{DownReason, NodeState};

/// A heartbeat that has not moved for this long marks the node DOWN (hung).
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(500);
/// How often the agent bumps its heartbeat.
pub const HEARTBEAT_PERIOD: Duration = Duration::from_millis(100);

/// A state change to publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    /// New state.
    pub state: NodeState,
    /// Generation after the change.
    pub generation: u32,
    /// Why, when DOWN.
    pub reason: DownReason,
}

/// One slot's life cycle.
#[derive(Debug, Clone)]
pub struct NodeLife {
    state: NodeState,
    generation: u32,
    beat: u64,
    beat_at: Instant,
    restart_at: Option<Instant>,
}

impl NodeLife {
    /// A slot that has never been occupied.
    pub fn new(now: Instant) -> Self {
        Self {
            state: NodeState::Empty,
            generation: 0,
            beat: 0,
            beat_at: now,
            restart_at: None,
        }
    }

    /// Current state.
    pub fn state(&self) -> NodeState {
        self.state
    }

    /// Current generation (0 before the first READY).
    pub fn generation(&self) -> u32 {
        self.generation
    }

    fn to(&mut self, state: NodeState, reason: DownReason) -> Transition {
        self.state = state;
        Transition {
            state,
            generation: self.generation,
            reason,
        }
    }

    /// The agent process was started.
    pub fn spawned(&mut self, now: Instant) -> Option<Transition> {
        self.restart_at = None;
        self.beat_at = now;
        match self.state {
            NodeState::Empty | NodeState::Down => {
                Some(self.to(NodeState::Booting, DownReason::None))
            }
            _ => None,
        }
    }

    /// The agent attached and its window is initialised: READY with a new generation.
    pub fn ready(&mut self, now: Instant, beat: u64) -> Option<Transition> {
        if self.state != NodeState::Booting {
            return None;
        }
        self.generation = self.generation.wrapping_add(1).max(1);
        self.beat = beat;
        self.beat_at = now;
        Some(self.to(NodeState::Ready, DownReason::None))
    }

    /// The agent process is gone; it will be restarted after `restart_delay` (if any).
    pub fn exited(&mut self, now: Instant, restart_delay: Option<Duration>) -> Option<Transition> {
        self.restart_at = restart_delay.map(|d| now + d);
        match self.state {
            NodeState::Booting | NodeState::Ready => {
                Some(self.to(NodeState::Down, DownReason::Exited))
            }
            NodeState::Down => None,
            NodeState::Empty => None,
        }
    }

    /// The node went DOWN for `reason` somewhere this supervisor only hears of (a node on
    /// another host): no restart from here.
    pub fn lost(&mut self, reason: DownReason) -> Option<Transition> {
        self.restart_at = None;
        (self.state != NodeState::Down && self.state != NodeState::Empty)
            .then(|| self.to(NodeState::Down, reason))
    }

    /// The fabric is stopping.
    pub fn shutdown(&mut self) -> Option<Transition> {
        self.restart_at = None;
        (self.state != NodeState::Down).then(|| self.to(NodeState::Down, DownReason::Shutdown))
    }

    /// The supervisor itself ran nothing for a while (see `supervisor::STALLED`): the
    /// heartbeat's silence is counted from `now`, not from before the pause.
    pub fn grace(&mut self, now: Instant) {
        self.beat_at = now;
    }

    /// A periodic check with the heartbeat value read from the window: a stalled READY node
    /// goes DOWN (hung); a hung node whose heartbeat moves again rejoins (BOOTING then READY,
    /// with a new generation).
    pub fn tick(&mut self, now: Instant, beat: u64, agent_alive: bool) -> Vec<Transition> {
        let moved = beat != self.beat;
        if moved {
            self.beat = beat;
            self.beat_at = now;
        }
        let mut out = Vec::new();
        match self.state {
            NodeState::Ready if now.duration_since(self.beat_at) >= HEARTBEAT_TIMEOUT => {
                out.push(self.to(NodeState::Down, DownReason::Hung));
            }
            NodeState::Down if agent_alive && moved => {
                out.push(self.to(NodeState::Booting, DownReason::None));
                out.extend(self.ready(now, beat));
            }
            _ => {}
        }
        out
    }

    /// True when the agent should be (re)started now.
    pub fn restart_due(&self, now: Instant) -> bool {
        self.state == NodeState::Down && self.restart_at.is_some_and(|t| t <= now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_boots_to_ready_with_generation_one() {
        let t = Instant::now();
        let mut n = NodeLife::new(t);
        assert_eq!(n.spawned(t).unwrap().state, NodeState::Booting);
        let r = n.ready(t, 0).unwrap();
        assert_eq!((r.state, r.generation), (NodeState::Ready, 1));
    }

    #[test]
    fn killed_node_goes_down_and_rejoins_with_new_generation() {
        let t = Instant::now();
        let mut n = NodeLife::new(t);
        n.spawned(t);
        n.ready(t, 0);
        let d = n.exited(t, Some(Duration::from_millis(300))).unwrap();
        assert_eq!((d.state, d.reason), (NodeState::Down, DownReason::Exited));
        assert!(!n.restart_due(t + Duration::from_millis(299)));
        assert!(n.restart_due(t + Duration::from_millis(300)));
        n.spawned(t);
        assert_eq!(n.ready(t, 0).unwrap().generation, 2);
    }

    #[test]
    fn stalled_heartbeat_marks_node_hung_and_a_moving_one_brings_it_back() {
        let t = Instant::now();
        let mut n = NodeLife::new(t);
        n.spawned(t);
        n.ready(t, 10);
        assert!(n.tick(t + Duration::from_millis(200), 11, true).is_empty());
        let stall = t + Duration::from_millis(200) + HEARTBEAT_TIMEOUT;
        let d = n.tick(stall, 11, true);
        assert_eq!(d[0].reason, DownReason::Hung);
        assert!(n
            .tick(stall + Duration::from_millis(50), 11, true)
            .is_empty());
        let back = n.tick(stall + Duration::from_millis(100), 12, true);
        assert_eq!(back.last().unwrap().state, NodeState::Ready);
        assert_eq!(back.last().unwrap().generation, 2);
    }

    #[test]
    fn after_the_supervisors_own_pause_a_heartbeat_gets_its_full_timeout_again() {
        let t = Instant::now();
        let mut n = NodeLife::new(t);
        n.spawned(t);
        n.ready(t, 10);
        // The supervisor ran nothing for 2 s (nor did the agent: the machine paused both).
        let back = t + Duration::from_secs(2);
        n.grace(back);
        assert!(n.tick(back, 10, true).is_empty(), "not hung for the pause");
        let late = n.tick(back + HEARTBEAT_TIMEOUT, 10, true);
        assert_eq!(
            late[0].reason,
            DownReason::Hung,
            "still hung if it stays silent"
        );
    }

    #[test]
    fn exited_node_without_restart_stays_down() {
        let t = Instant::now();
        let mut n = NodeLife::new(t);
        n.spawned(t);
        n.ready(t, 0);
        n.exited(t, None);
        assert!(!n.restart_due(t + Duration::from_secs(100)));
        assert!(n.tick(t + Duration::from_secs(1), 5, false).is_empty());
    }
}
