//! Large host allocations kept for reuse instead of returned to the system.
//!
//! A decode allocates and frees the same sizes over and over (each layer's activations, its
//! convolution's scratch). Returned to the system, every one of them comes back as fresh pages
//! that fault in one by one on first touch: measured, a quarter of a CPU decode's time went to
//! the kernel's page-fault handling. Freed tensor buffers of at least [`MIN_BYTES`] therefore
//! wait here, and a later allocation takes back the smallest that holds it, if that is at most
//! an eighth (`SLACK`) longer (a buffer may then be shorter than its vector).
//!
//! The pool holds only memory the process had already needed at once. It counts the bytes the
//! large buffers use and their high-water mark (what they take without the pool), and before an
//! allocation the pool cannot serve, or after one made elsewhere, it frees pooled vectors (the
//! oldest first) until pooled and live vectors fit under that mark. So the large buffers'
//! resident size peaks where it would without the pool (plus, at most, the unused tails of
//! reused vectors, an eighth), provided the system allocator returns a freed large vector to
//! the system at once (glibc does for allocations it maps, those over `M_MMAP_THRESHOLD`; its
//! dynamic threshold otherwise serves some from its heap, which it keeps: the CLI fixes the
//! threshold at 1 MiB). [`trim`] empties the pool (an engine that goes idle may call it);
//! [`pooled_bytes`] says what it holds; `VAE_RECYCLE=0` turns it off.
//!
//! A size the pool cannot serve within the slack still reuses pooled memory: of the oldest
//! vectors evicted to make room under the mark, the longest is resized into the new one. glibc
//! resizes a mapped vector in place or by moving its pages (`mremap`: no copy), so a shrunk
//! vector faults nothing in and a grown one only its new tail, where freeing it and mapping a
//! new one would fault every page in again (on the FLUX.1 decode at 256² in bf16, 107 thousand
//! page faults per decode before, 59 thousand after, 1.22 → 1.09 s).

use std::sync::Mutex;

/// Smallest allocation kept, in bytes: below it the allocator reuses memory by itself.
pub const MIN_BYTES: usize = 1 << 20;

/// A pooled vector serves a buffer `1 / SLACK` shorter at the most.
const SLACK: usize = 8;

/// Freed vectors (oldest first) and the byte counts that bound them.
#[derive(Default)]
struct Pool {
    free: Vec<Vec<f32>>,
    /// Bytes of the vectors in `free`.
    pooled: usize,
    /// Bytes of the large vectors alive (taken or adopted, not yet given back).
    live: usize,
    /// Bytes of them their buffers use.
    used: usize,
    /// The high-water mark of `used`.
    peak: usize,
}

impl Pool {
    const fn new() -> Self {
        Self { free: Vec::new(), pooled: 0, live: 0, used: 0, peak: 0 }
    }

    /// For a buffer of `len` elements, the shortest pooled vector that holds it and is at most
    /// `1 / SLACK` longer (the most recently freed of those), now alive; or else what to make it
    /// from and what to free ([`Miss`]).
    fn take(&mut self, len: usize) -> Result<Vec<f32>, Miss> {
        let fits = |v: &Vec<f32>| v.len() >= len && v.len() - len <= len / SLACK;
        let best = (0..self.free.len()).rev().filter(|&i| fits(&self.free[i])).min_by_key(|&i| self.free[i].len());
        let bytes = len * std::mem::size_of::<f32>();
        if let Some(i) = best {
            let v = self.free.remove(i);
            self.pooled -= bytes_of(&v);
            self.live += bytes_of(&v);
            self.used += bytes;
            self.peak = self.peak.max(self.used);
            return Ok(v);
        }
        // The oldest vectors make room; the longest of them is resized into the new one.
        let mut evicted = self.room_for(bytes);
        let longest = (0..evicted.len()).max_by_key(|&i| evicted[i].len());
        let reuse = longest.map(|i| evicted.swap_remove(i));
        Err(Miss { reuse, evicted })
    }

    /// Counts a new vector of `bytes`, `used` of them in use, alive; returns the pooled vectors
    /// to free to keep under the mark (a vector allocated elsewhere did not make room first).
    fn adopt(&mut self, bytes: usize, used: usize) -> Vec<Vec<f32>> {
        let evicted = self.room_for(bytes);
        self.live += bytes;
        self.used += used;
        self.peak = self.peak.max(self.used);
        evicted
    }

    /// Removes the oldest pooled vectors until `bytes` more fit: pooled + live + `bytes` at
    /// most the mark (or what is in use then, if that is higher).
    fn room_for(&mut self, bytes: usize) -> Vec<Vec<f32>> {
        let mark = self.peak.max(self.used + bytes);
        let mut n = 0;
        while n < self.free.len() && self.pooled + self.live + bytes > mark {
            self.pooled -= bytes_of(&self.free[n]);
            n += 1;
        }
        self.free.drain(..n).collect()
    }

    /// Stops counting a vector of `bytes` alive whose buffer used `used` bytes.
    fn forget(&mut self, bytes: usize, used: usize) {
        self.live = self.live.saturating_sub(bytes);
        self.used = self.used.saturating_sub(used);
    }

    /// Takes back a vector counted alive whose buffer used `used` bytes; keeps it if `keep`.
    fn give(&mut self, v: Vec<f32>, used: usize, keep: bool) {
        self.live = self.live.saturating_sub(bytes_of(&v));
        self.used = self.used.saturating_sub(used);
        if keep {
            self.pooled += bytes_of(&v);
            self.free.push(v);
        }
    }
}

static POOL: Mutex<Pool> = Mutex::new(Pool::new());

fn pool() -> std::sync::MutexGuard<'static, Pool> {
    // The counts are only ever changed together under the lock; a panicking holder cannot
    // leave them halfway.
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

fn bytes_of(v: &Vec<f32>) -> usize {
    v.capacity() * std::mem::size_of::<f32>()
}

/// Whether the pool is on, once decided ([`enabled`]).
static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
/// Whether [`crate::process::configure`] turned the pool on or off, over `VAE_RECYCLE`.
static REQUESTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Turns the pool on or off as `VAE_RECYCLE` does, before the first large buffer decides;
/// `false` once it was decided (or set) already.
pub(crate) fn request(on: bool) -> bool {
    ON.get().is_none() && REQUESTED.set(on).is_ok()
}

/// Whether the pool is on: [`request`]'s word, else `VAE_RECYCLE=0` (or `off`, `false`, `no`) turns it off. Read once.
fn enabled() -> bool {
    *ON.get_or_init(|| {
        if let Some(on) = REQUESTED.get() {
            return *on;
        }
        let off = std::env::var("VAE_RECYCLE")
            .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "off" | "false" | "no"));
        !off
    })
}

/// Whether vectors of this capacity are counted and pooled.
fn large(capacity: usize) -> bool {
    capacity * std::mem::size_of::<f32>() >= MIN_BYTES
}

/// A vector for a buffer of `len` elements, at least that long (at most `1 / SLACK` longer): a
/// pooled one holding earlier values (perhaps resized to `len`), or a new zeroed one of exactly
/// `len`. The flag says whether it may hold earlier values. Either way it is counted alive until
/// [`give`]n back.
pub(crate) fn take(len: usize) -> (Vec<f32>, bool) {
    if large(len) && enabled() {
        let taken = pool().take(len);
        match taken {
            Ok(v) => return (v, true),
            Err(Miss { reuse, evicted }) => {
                drop(evicted); // freed outside the lock
                if let Some(mut v) = reuse {
                    resize_exact(&mut v, len);
                    adopt(&v);
                    return (v, true);
                }
            }
        }
    }
    let v = vec![0.0; len];
    adopt(&v);
    (v, false)
}

/// What a buffer the pool holds nothing close to is made from.
#[derive(Debug)]
struct Miss {
    /// The longest of the vectors evicted, to resize to the length asked for (no longer pooled,
    /// not yet alive).
    reuse: Option<Vec<f32>>,
    /// The other evicted vectors, to free: with `reuse` they are the oldest pooled vectors whose
    /// bytes make room for the new vector under the mark.
    evicted: Vec<Vec<f32>>,
}

/// `v` with exactly `len` elements and no spare capacity: its first elements kept, new ones
/// zero.
fn resize_exact(v: &mut Vec<f32>, len: usize) {
    if len <= v.len() {
        v.truncate(len);
        v.shrink_to_fit();
    } else {
        v.reserve_exact(len - v.len());
        v.resize(len, 0.0);
    }
}

/// Counts a vector alive (if large), all of it in use, for [`give`] to take back.
pub(crate) fn adopt(v: &Vec<f32>) {
    if large(v.capacity()) {
        let evicted = pool().adopt(bytes_of(v), v.len() * std::mem::size_of::<f32>());
        drop(evicted); // freed outside the lock
    }
}

/// Takes back a vector counted by [`take`] or [`adopt`] whose buffer used `len` elements of
/// it, and keeps it for a later [`take`].
pub(crate) fn give(v: Vec<f32>, len: usize) {
    if large(v.capacity()) {
        let keep = v.len() == v.capacity() && enabled();
        pool().give(v, len * std::mem::size_of::<f32>(), keep);
    }
}

/// Stops counting a vector counted by [`take`] or [`adopt`] (whose buffer used `len` elements
/// of it) that leaves the tensors for good: it is neither alive here any more nor pooled.
pub(crate) fn disown(v: &Vec<f32>, len: usize) {
    if large(v.capacity()) {
        pool().forget(bytes_of(v), len * std::mem::size_of::<f32>());
    }
}

/// Returns every pooled buffer to the system; the bytes released.
pub fn trim() -> usize {
    let free = {
        let mut p = pool();
        p.pooled = 0;
        std::mem::take(&mut p.free)
    };
    free.iter().map(bytes_of).sum()
}

/// Bytes the pool holds now.
pub fn pooled_bytes() -> usize {
    pool().pooled
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = (1 << 20) / 4; // f32 elements

    /// A buffer of `len` elements from the pool as [`take`] makes it: a pooled one, one resized
    /// from a pooled one, or a new vector.
    fn alloc(p: &mut Pool, len: usize) -> Vec<f32> {
        p.take(len).unwrap_or_else(|Miss { reuse, evicted }| {
            drop(evicted);
            let mut v = reuse.unwrap_or_default();
            resize_exact(&mut v, len);
            assert!(p.adopt(bytes_of(&v), bytes_of(&v)).is_empty());
            v
        })
    }

    fn lens(vs: &[Vec<f32>]) -> Vec<usize> {
        vs.iter().map(Vec::len).collect()
    }

    #[test]
    fn reuses_freed_vectors_and_stays_under_the_high_water_mark() {
        let mut p = Pool::new();
        // 1, 2 and 1 MiB alive at once: the mark is 4 MiB.
        let mut bufs: Vec<Vec<f32>> = [MIB, 2 * MIB, MIB].into_iter().map(|len| alloc(&mut p, len)).collect();
        bufs[2][0] = 7.0;
        assert_eq!((p.live, p.peak), (4 << 20, 4 << 20));
        for v in bufs.drain(..) {
            let bytes = bytes_of(&v);
            p.give(v, bytes, true);
        }
        assert_eq!((p.live, p.used, p.pooled), (0, 0, 4 << 20));
        // The shortest that holds it, the most recently freed of those, with its contents.
        let v = p.take(MIB - 5).unwrap();
        assert_eq!((v.len(), v[0]), (MIB, 7.0));
        assert_eq!((p.live, p.used, p.pooled), (1 << 20, (1 << 20) - 20, 3 << 20));
        // An eighth longer at the most: 2 MiB serves 1.8 MiB ...
        let w = p.take(MIB * 9 / 5).unwrap();
        assert_eq!(w.len(), 2 * MIB);
        p.give(w, MIB * 9 / 5 * 4, true);
        // ... not 1.5 MiB: a miss, for which the oldest pooled vectors (1, then 2 MiB) make room
        // to keep 1.5 MiB more under the mark; the longer of them becomes the new one.
        let miss = p.take(MIB * 3 / 2).unwrap_err();
        assert_eq!((miss.reuse.as_ref().map(Vec::len), lens(&miss.evicted)), (Some(2 * MIB), vec![MIB]));
        assert_eq!(p.pooled, 0);
        let mut x = miss.reuse.unwrap();
        resize_exact(&mut x, MIB * 3 / 2);
        assert_eq!((x.len(), x.capacity()), (MIB * 3 / 2, MIB * 3 / 2));
        assert!(p.adopt(bytes_of(&x), bytes_of(&x)).is_empty());
        assert!(p.pooled + p.live <= p.peak);
        p.give(x, MIB * 3 / 2 * 4, true);
        // 3 MiB, longer than anything pooled: the 1.5 MiB vector makes room and is grown.
        let miss = p.take(3 * MIB).unwrap_err();
        assert_eq!((miss.reuse.as_ref().map(Vec::len), lens(&miss.evicted)), (Some(MIB * 3 / 2), vec![]));
        let mut y = miss.reuse.unwrap();
        y[1] = 5.0;
        resize_exact(&mut y, 3 * MIB);
        assert_eq!((y.len(), y[1], y[3 * MIB - 1]), (3 * MIB, 5.0, 0.0), "kept, then zeros");
        assert!(p.adopt(3 << 20, 3 << 20).is_empty());
        assert!(p.pooled + p.live <= p.peak);
        // Beyond the mark with nothing pooled: nothing to reuse or free, and the mark rises.
        let miss = p.take(MIB).unwrap_err();
        assert!(miss.reuse.is_none() && miss.evicted.is_empty());
        assert!(p.adopt(1 << 20, 1 << 20).is_empty());
        assert_eq!(p.peak, (5 << 20) - 20);
        // A vector made elsewhere makes room after the fact.
        p.give(v, (MIB - 5) * 4, true);
        assert_eq!((p.live, p.pooled), (4 << 20, 1 << 20));
        let evicted = p.adopt(1 << 20, 1 << 20);
        assert_eq!(evicted.len(), 1);
        assert!(p.pooled + p.live <= p.peak + 20);
    }

    /// A resized vector keeps its head, gets zeros past it, and has no spare capacity.
    #[test]
    fn resizing_keeps_the_head_and_no_spare_capacity() {
        let mut v = vec![1.0f32; 3 * MIB];
        resize_exact(&mut v, 2 * MIB);
        assert_eq!((v.len(), v.capacity(), v[2 * MIB - 1]), (2 * MIB, 2 * MIB, 1.0));
        resize_exact(&mut v, 4 * MIB);
        assert_eq!((v.len(), v.capacity(), v[2 * MIB - 1], v[2 * MIB]), (4 * MIB, 4 * MIB, 1.0, 0.0));
    }

    #[test]
    fn only_large_vectors_are_counted() {
        assert!(!large(16));
        assert!(large(MIN_BYTES / 4));
        let (v, reused) = take(100);
        assert!(!reused && v.len() == 100);
    }
}
