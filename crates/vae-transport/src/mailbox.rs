//! Handing values between the ranks of one in-process group without serialising them.
//!
//! The byte collectives copy every payload into and out of a frame. Ranks that are threads of
//! one process can instead hand each other the value itself (a device tensor stays on its
//! device: the receiver copies device-to-device, nothing goes through host memory). The
//! mailbox only stores values; ordering and failure detection come from a byte exchange the
//! caller makes after posting (a token), so a value is always in place before its receiver
//! looks for it, and a failed peer is reported exactly as on the byte path.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// A value in transit.
pub type Parcel = Box<dyn Any + Send>;

/// Per (sender, receiver) queues of values, shared by the ranks of one in-process group (see
/// [`crate::Communicator::mailbox`]).
#[derive(Default)]
pub struct Mailbox {
    queues: Mutex<HashMap<(usize, usize), VecDeque<Parcel>>>,
}

impl std::fmt::Debug for Mailbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let queued: usize = self.lock().values().map(VecDeque::len).sum();
        f.debug_struct("Mailbox").field("queued", &queued).finish()
    }
}

impl Mailbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(usize, usize), VecDeque<Parcel>>> {
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `value` from rank `from` for rank `to` (after the values posted before it).
    pub fn post(&self, from: usize, to: usize, value: Parcel) {
        self.lock().entry((from, to)).or_default().push_back(value);
    }

    /// The oldest value rank `from` posted for rank `to`, if any.
    pub fn take(&self, from: usize, to: usize) -> Option<Parcel> {
        self.lock().get_mut(&(from, to)).and_then(VecDeque::pop_front)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_arrive_in_order_per_pair() {
        let mailbox = Mailbox::default();
        mailbox.post(0, 1, Box::new(1u32));
        mailbox.post(0, 1, Box::new(2u32));
        mailbox.post(2, 1, Box::new("from two"));
        let take = |from| mailbox.take(from, 1).map(|v| v.downcast::<u32>().map(|b| *b).ok());
        assert_eq!(take(0), Some(Some(1)));
        assert_eq!(take(0), Some(Some(2)));
        assert!(take(0).is_none(), "empty after two");
        assert_eq!(*mailbox.take(2, 1).unwrap().downcast::<&str>().unwrap(), "from two");
        assert!(mailbox.take(1, 0).is_none());
    }
}
