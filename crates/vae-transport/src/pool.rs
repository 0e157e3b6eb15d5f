//! Reusable payload buffers.
//!
//! Every large message needs a buffer on the receiving side (and, in the local backend, one
//! shared copy on the sending side). Allocating a fresh one per message is dominated by page
//! faults: a 32 MiB all_gather over Unix sockets measured 4× slower with fresh buffers than with
//! reused ones. Buffers return here when the last reference to a payload drops.

use std::io::Read;
use std::ops::Deref;
use std::sync::{Arc, Mutex};

/// Most idle bytes a pool keeps; beyond that, returned buffers are freed.
const MAX_IDLE_BYTES: usize = 256 << 20;
/// Most idle buffers a pool keeps.
const MAX_IDLE_BUFFERS: usize = 16;
/// Buffers smaller than this are not worth pooling (the allocator serves them from its heap).
const MIN_POOLED: usize = 64 << 10;

/// A set of idle byte buffers.
#[derive(Debug, Default)]
pub(crate) struct BufferPool {
    idle: Mutex<Vec<Vec<u8>>>,
}

impl BufferPool {
    /// An empty buffer, with an idle buffer's capacity when one of at least `capacity` bytes
    /// is available (contents are appended by the caller, so nothing is zero-filled).
    pub(crate) fn take(self: &Arc<Self>, capacity: usize) -> PooledBuf {
        let mut data = if capacity >= MIN_POOLED {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            // Smallest idle buffer that fits, so big buffers stay for big messages.
            let best = idle
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= capacity)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i);
            best.map(|i| idle.swap_remove(i)).unwrap_or_default()
        } else {
            Vec::new()
        };
        data.clear();
        PooledBuf { data, pool: Some(Arc::clone(self)) }
    }

    /// A pooled copy of `bytes`.
    pub(crate) fn copy_of(self: &Arc<Self>, bytes: &[u8]) -> PooledBuf {
        let mut buf = self.take(bytes.len());
        buf.data.extend_from_slice(bytes);
        buf
    }

    fn give_back(&self, data: Vec<u8>) {
        if data.capacity() < MIN_POOLED {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.push(data);
        // Over budget: drop the smallest buffers first.
        idle.sort_unstable_by_key(|b| std::cmp::Reverse(b.capacity()));
        let mut kept_bytes = 0;
        let mut keep = 0;
        for b in idle.iter() {
            if keep == MAX_IDLE_BUFFERS || kept_bytes + b.capacity() > MAX_IDLE_BYTES {
                break;
            }
            kept_bytes += b.capacity();
            keep += 1;
        }
        idle.truncate(keep);
    }

    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.idle.lock().unwrap().len()
    }
}

/// A byte buffer that returns to its pool when dropped.
#[derive(Debug, Default)]
pub(crate) struct PooledBuf {
    data: Vec<u8>,
    pool: Option<Arc<BufferPool>>,
}

impl PooledBuf {
    /// Appends exactly `len` bytes from `reader`, growing the buffer only as bytes arrive (in
    /// steps of at most `step`), so a peer that announces more than it sends cannot make this
    /// process allocate it. Allocation failure is an error, not an abort.
    pub(crate) fn fill_from(&mut self, reader: &mut impl Read, len: usize, step: usize) -> std::io::Result<()> {
        let mut remaining = len;
        while remaining > 0 {
            let chunk = remaining.min(step.max(1));
            self.data.try_reserve(chunk).map_err(|e| {
                std::io::Error::new(std::io::ErrorKind::OutOfMemory, format!("cannot buffer a {len}-byte message: {e}"))
            })?;
            let got = reader.by_ref().take(chunk as u64).read_to_end(&mut self.data)?;
            if got < chunk {
                return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "message cut short"));
            }
            remaining -= chunk;
        }
        Ok(())
    }
}

impl Deref for PooledBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.data
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.give_back(std::mem::take(&mut self.data));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_and_the_pool_is_bounded() {
        let pool = Arc::new(BufferPool::default());
        let first = pool.copy_of(&vec![7u8; 1 << 20]);
        let ptr = first.as_ptr();
        drop(first);
        assert_eq!(pool.idle_count(), 1);
        let mut again = pool.take(1000 << 10);
        again.fill_from(&mut &vec![1u8; 1000 << 10][..], 1000 << 10, 4096).unwrap();
        assert_eq!(again.as_ptr(), ptr, "the idle buffer is reused");
        assert_eq!(again.len(), 1000 << 10);
        drop(again);
        let many: Vec<_> = (0..40).map(|_| pool.take(1 << 20)).collect();
        drop(many);
        assert!(pool.idle_count() <= MAX_IDLE_BUFFERS);
        let small = pool.copy_of(b"abc");
        assert_eq!(&*small, b"abc");
        let mut short = pool.take(0);
        let err = short.fill_from(&mut &b"only ten b"[..], 100, 64).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof);
    }
}
