//! How a session's waiter thread waits for the GPU in a stream synchronize that did not end
//! within the connection thread's brief poll (issue 12 §4: the server's wait for the GPU).
//!
//! NVIDIA's driver waits in `cuStreamSynchronize` as the context's scheduling flags say; with
//! the default (`CU_CTX_SCHED_AUTO`) and one context per process it spins for the whole wait.
//! With a core to spare that costs no one anything and answers soonest. With none, it holds a
//! core for every microsecond of the wait (measured on an H200: ~150 µs of server CPU per
//! launch + synchronize with 4 clients beside 1x load, whatever `REMORA_WAIT` said), taking
//! it from the clients and from the other sessions. There the waiter thread sleeps first, in
//! `cuEventSynchronize` on an event of its own made with `CU_EVENT_BLOCKING_SYNC` and
//! recorded on the stream (the driver wakes it by interrupt), and then makes the
//! synchronize itself, which finds the work done: the synchronize's result, its device
//! output and its copies come from it as before, so the event only decides how the thread
//! waits, never what the call answers.

/// `CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING`.
pub(crate) const SLEEPING_EVENT_FLAGS: u32 = 0x1 | 0x2;

/// How waiter threads wait for the GPU ([`crate::Executor::set_gpu_wait`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuWait {
    /// Sleep on an event while the host has no core to spare
    /// ([`remora_shm::cores_to_spare`]), let the driver wait otherwise: `REMORA_WAIT`
    /// adaptive (the default).
    Auto,
    /// Always let the driver wait (it spins with the default context flags):
    /// `REMORA_WAIT=spin`.
    Driver,
    /// Always sleep on an event first: `REMORA_WAIT=block`.
    Sleep,
}

impl GpuWait {
    /// From this process's `REMORA_WAIT` ([`remora_shm::WaitPolicy`]), so that the policy
    /// `remora bench contention` compares holds in this place too.
    pub fn from_env() -> Self {
        match remora_shm::WaitPolicy::from_env() {
            remora_shm::WaitPolicy::Adaptive => Self::Auto,
            remora_shm::WaitPolicy::Spin => Self::Driver,
            remora_shm::WaitPolicy::Block => Self::Sleep,
        }
    }

    /// Whether a wait starting now sleeps on an event first.
    pub(crate) fn sleeps(self) -> bool {
        match self {
            Self::Auto => !remora_shm::cores_to_spare(),
            Self::Driver => false,
            Self::Sleep => true,
        }
    }

    pub(crate) fn to_u8(self) -> u8 {
        match self {
            Self::Auto => 0,
            Self::Driver => 1,
            Self::Sleep => 2,
        }
    }

    pub(crate) fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Driver,
            2 => Self::Sleep,
            _ => Self::Auto,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_survives_its_atomic_form() {
        for w in [GpuWait::Auto, GpuWait::Driver, GpuWait::Sleep] {
            assert_eq!(GpuWait::from_u8(w.to_u8()), w);
        }
        assert!(GpuWait::Sleep.sleeps());
        assert!(!GpuWait::Driver.sleeps());
    }
}
