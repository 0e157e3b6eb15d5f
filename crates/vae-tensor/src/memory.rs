//! Per-thread accounting of live tensor bytes and their high-water mark.
//!
//! Each thread charges one account, its own unless told otherwise ([`Account`]); the threads
//! of a local rank all charge the rank's, so an account is a per-rank counter. Every CPU buffer
//! a tensor owns (and the large scratch buffers ops allocate while they run) is charged to the
//! account of the thread that allocated it, and released from that same account when it is
//! dropped, whichever thread drops it: a tensor handed to another rank's thread must not make
//! the sender's count drift. The buffer therefore holds a shared handle to its counter
//! instead of looking up the dropping thread's one.
//!
//! Bytes are the tensor's element bytes (`len × 4` for f32), not the allocator's capacity.
//!
//! Device memory (CUDA tensor storage) is counted the same way in a second pair of counters of
//! the same account ([`device_live_bytes`], [`device_peak_bytes`]): a rank's host and device
//! high-water marks are reported side by side.

use std::cell::RefCell;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Live bytes and their high-water mark. Atomics because releases may come from other threads.
#[derive(Debug, Default)]
struct Gauge {
    live: AtomicUsize,
    peak: AtomicUsize,
}

impl Gauge {
    fn charge(&self, bytes: usize) {
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn release(&self, bytes: usize) {
        self.live.fetch_sub(bytes, Ordering::Relaxed);
    }

    fn reset_peak(&self) {
        self.peak.store(self.live.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// One account's counters: host buffers and device storage.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    host: Gauge,
    device: Gauge,
}

thread_local! {
    /// The account this thread charges: its own unless an [`AccountGuard`] redirects it.
    static CURRENT: RefCell<Arc<Counters>> = RefCell::new(Arc::new(Counters::default()));
}

/// The current thread's counters. During thread teardown, when the thread-local is gone, a
/// detached counter keeps allocation working (nobody can read that thread's counts any more).
fn current() -> Arc<Counters> {
    CURRENT.try_with(|c| Arc::clone(&c.borrow())).unwrap_or_default()
}

/// Bytes of tensor storage charged to the current thread's account that are still alive.
pub fn live_bytes() -> usize {
    Account::current().live_bytes()
}

/// The most bytes that were alive at once in the current thread's account since it was
/// created or since the last [`reset_peak`].
pub fn peak_bytes() -> usize {
    Account::current().peak_bytes()
}

/// Restarts the current thread's high-water marks (host and device) from its live bytes, to
/// measure one phase.
pub fn reset_peak() {
    Account::current().reset_peak();
}

/// Bytes of device (CUDA) tensor storage charged to the current thread's account that are
/// still alive.
pub fn device_live_bytes() -> usize {
    Account::current().device_live_bytes()
}

/// The most device tensor bytes alive at once in the current thread's account since it was
/// created or since the last [`reset_peak`].
pub fn device_peak_bytes() -> usize {
    Account::current().device_peak_bytes()
}

/// A set of counters that allocations are charged to. Every thread starts with its own.
///
/// Work run through `rayon::ThreadPool::install` executes on a pool thread, so its
/// allocations would be charged to that thread. A rank that runs its ops in a pool of its own
/// therefore has every thread of the pool [`Account::adopt`] the rank's account when it starts,
/// so that the rank's high-water mark sees them; a closure run in a shared pool
/// [`Account::enter`]s it instead.
#[derive(Debug, Clone, Default)]
pub struct Account(Arc<Counters>);

impl Account {
    /// A new account with nothing charged.
    pub fn new() -> Self {
        Self::default()
    }

    /// The account the current thread charges now.
    pub fn current() -> Self {
        Self(current())
    }

    /// Live host bytes charged to this account.
    pub fn live_bytes(&self) -> usize {
        self.0.host.live.load(Ordering::Relaxed)
    }

    /// High-water mark of [`Account::live_bytes`] since creation or the last reset.
    pub fn peak_bytes(&self) -> usize {
        self.0.host.peak.load(Ordering::Relaxed)
    }

    /// Live device bytes charged to this account.
    pub fn device_live_bytes(&self) -> usize {
        self.0.device.live.load(Ordering::Relaxed)
    }

    /// High-water mark of [`Account::device_live_bytes`] since creation or the last reset.
    pub fn device_peak_bytes(&self) -> usize {
        self.0.device.peak.load(Ordering::Relaxed)
    }

    /// Restarts both high-water marks from the live bytes.
    pub fn reset_peak(&self) {
        self.0.host.reset_peak();
        self.0.device.reset_peak();
    }

    /// Charges every allocation the current thread makes from now on to this account, for the
    /// rest of the thread's life (an [`Account::enter`] inside still redirects it for a while):
    /// for the threads of a pool that serves one rank alone, started with this as their start
    /// handler, so that the rank's high-water mark sees whatever its tasks allocate.
    pub fn adopt(&self) {
        // Fails only during thread teardown, when nothing is allocated any more.
        let _ = CURRENT.try_with(|c| c.replace(Arc::clone(&self.0)));
    }

    /// Charges the current thread's allocations to this account until the guard drops.
    pub fn enter(&self) -> AccountGuard {
        let previous = CURRENT.with(|c| c.replace(Arc::clone(&self.0)));
        AccountGuard { previous: Some(previous), _same_thread: PhantomData }
    }
}

/// Restores the thread's previous account on drop; see [`Account::enter`]. Not `Send`, so it
/// is dropped on the thread whose account it changed.
#[derive(Debug)]
pub struct AccountGuard {
    previous: Option<Arc<Counters>>,
    _same_thread: PhantomData<*const ()>,
}

impl Drop for AccountGuard {
    fn drop(&mut self) {
        if let Some(previous) = self.previous.take() {
            // Ignoring the error is right: it only fails during thread teardown.
            let _ = CURRENT.try_with(|c| c.replace(previous));
        }
    }
}

/// An f32 buffer charged to the allocating thread's counters for as long as it lives; or
/// another owner's memory read in place ([`Buffer::lent`]), which is not charged.
pub(crate) struct Buffer {
    /// The allocation: at least `len` elements (a recycled one may be longer); empty while
    /// the elements are lent.
    data: Vec<f32>,
    /// The elements in use.
    len: usize,
    counters: Arc<Counters>,
    /// Set while the elements are another owner's memory, read in place and never written:
    /// a mutable access copies them into `data` first.
    lent: Option<Lent>,
}

/// Memory a caller lent: its first element, and what keeps it alive.
struct Lent {
    ptr: std::ptr::NonNull<f32>,
    _owner: Arc<dyn std::any::Any + Send + Sync>,
}

// SAFETY: the lent memory is only ever read (`Buffer::as_mut_slice` copies it first), and
// `Buffer::lent`'s contract keeps it valid and unwritten while the owner lives.
unsafe impl Send for Lent {}
// SAFETY: as above.
unsafe impl Sync for Lent {}

impl Buffer {
    /// Takes ownership of `data` and charges it to the current thread.
    pub(crate) fn from_vec(data: Vec<f32>) -> Self {
        crate::recycle::adopt(&data);
        let len = data.len();
        Self::counted(data, len)
    }

    /// Charges the first `len` elements of `data` (already counted by [`crate::recycle`]) to
    /// the current thread.
    fn counted(data: Vec<f32>, len: usize) -> Self {
        debug_assert!(len <= data.len());
        let counters = current();
        counters.host.charge(byte_len(&data[..len]));
        Self { data, len, counters, lent: None }
    }

    /// `len` elements at `ptr`, read in place while `owner` lives (no copy, not charged).
    ///
    /// # Safety
    /// `ptr` must be non-null, aligned and point to `len` initialised f32 values that stay
    /// valid, and that nobody writes, for as long as `owner` is alive.
    pub(crate) unsafe fn lent(ptr: *const f32, len: usize, owner: Arc<dyn std::any::Any + Send + Sync>) -> Self {
        let ptr = std::ptr::NonNull::new(ptr.cast_mut()).unwrap_or(std::ptr::NonNull::dangling());
        Self { data: Vec::new(), len, counters: current(), lent: Some(Lent { ptr, _owner: owner }) }
    }

    /// Lent elements copied into memory of this buffer's own (charged), so they can be written.
    fn own(&mut self) {
        if self.lent.is_none() {
            return;
        }
        let (mut data, _) = crate::recycle::take(self.len);
        data[..self.len].copy_from_slice(self.as_slice());
        self.counters.host.charge(byte_len(&data[..self.len]));
        self.data = data;
        self.lent = None;
    }

    /// A zero-filled buffer of `len` elements.
    pub(crate) fn zeros(len: usize) -> Self {
        let (mut data, reused) = crate::recycle::take(len);
        if reused {
            data[..len].fill(0.0);
        }
        Self::counted(data, len)
    }

    /// A buffer of `len` elements whose contents are unspecified (zeros, or the values of an
    /// earlier buffer): for ops that write every element before reading any.
    pub(crate) fn for_overwrite(len: usize) -> Self {
        Self::counted(crate::recycle::take(len).0, len)
    }

    /// The elements.
    pub(crate) fn as_slice(&self) -> &[f32] {
        match &self.lent {
            // SAFETY: `Buffer::lent`'s contract: `len` valid values, alive and unwritten while
            // the owner (held here) lives.
            Some(lent) => unsafe { std::slice::from_raw_parts(lent.ptr.as_ptr(), self.len) },
            None => &self.data[..self.len],
        }
    }

    /// The elements as a vector of their own, without a copy: the memory leaves the account and
    /// the recycle pool (the vector may have spare capacity, from a reused allocation).
    pub(crate) fn into_vec(mut self) -> Vec<f32> {
        self.own();
        let mut data = std::mem::take(&mut self.data);
        self.counters.host.release(byte_len(&data[..self.len]));
        crate::recycle::disown(&data, self.len);
        data.truncate(self.len);
        // Nothing left for `drop` to release or give back.
        self.len = 0;
        data
    }

    /// The elements, mutable. A slice, not the `Vec`, so the charged length cannot change.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [f32] {
        self.own();
        &mut self.data[..self.len]
    }
}

fn byte_len(data: &[f32]) -> usize {
    std::mem::size_of_val(data)
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.lent.is_some() {
            return; // not charged, not ours to give back
        }
        self.counters.host.release(byte_len(&self.data[..self.len]));
        crate::recycle::give(std::mem::take(&mut self.data), self.len);
    }
}

/// `bytes` of device storage charged to the allocating thread's account until dropped; the
/// device backend holds one per allocation.
#[derive(Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only the CUDA backend allocates device memory
pub(crate) struct DeviceCharge {
    bytes: usize,
    counters: Arc<Counters>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl DeviceCharge {
    /// Charges `bytes` to the current thread's account.
    pub(crate) fn new(bytes: usize) -> Self {
        let counters = current();
        counters.device.charge(bytes);
        Self { bytes, counters }
    }
}

impl Drop for DeviceCharge {
    fn drop(&mut self) {
        self.counters.device.release(self.bytes);
    }
}

impl Clone for Buffer {
    /// A copy is a new allocation, charged to the thread that makes it.
    fn clone(&self) -> Self {
        let mut copy = Self::for_overwrite(self.len);
        copy.as_mut_slice().copy_from_slice(self.as_slice());
        copy
    }
}

impl PartialEq for Buffer {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_slice().fmt(f)
    }
}

/// Caps the memory a request may plan for on this machine (bytes, or with a `K`, `M`, `G` or
/// `T` suffix, powers of 1024): the lower of it and the memory the system has available.
pub const ENV_MEMORY_LIMIT: &str = "VAE_MEMORY_LIMIT";

/// The cap [`crate::process::configure`] set, over [`ENV_MEMORY_LIMIT`].
static LIMIT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

/// Caps the memory a request may plan for, as [`ENV_MEMORY_LIMIT`] does; `false` once set.
pub(crate) fn request_limit(bytes: u64) -> bool {
    LIMIT.set(bytes).is_ok()
}

/// Host bytes a request may plan for: the system's available memory (Linux `MemAvailable`) or
/// the process's cap ([`crate::process::configure`], else [`ENV_MEMORY_LIMIT`]), whichever is
/// lower; `None` when neither is known.
pub fn available_host_bytes() -> Option<u64> {
    let system = std::fs::read_to_string("/proc/meminfo").ok().and_then(|text| {
        let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib * 1024)
    });
    let limit = LIMIT.get().copied().or_else(|| std::env::var(ENV_MEMORY_LIMIT).ok().and_then(|v| parse_bytes(&v)));
    match (system, limit) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `123`, `64K`, `8G`, `1.5T` (powers of 1024).
fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let (number, unit) = match text.char_indices().last()? {
        (i, c) if c.is_ascii_alphabetic() => (&text[..i], c.to_ascii_uppercase()),
        _ => (text, 'B'),
    };
    let scale: f64 = match unit {
        'B' => 1.0,
        'K' => 1024.0,
        'M' => 1024.0 * 1024.0,
        'G' => 1024.0 * 1024.0 * 1024.0,
        'T' => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    let value: f64 = number.trim().parse().ok()?;
    (value.is_finite() && value >= 0.0).then_some((value * scale) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_bytes("123"), Some(123));
        assert_eq!(parse_bytes("64k"), Some(64 << 10));
        assert_eq!(parse_bytes("8G"), Some(8 << 30));
        assert_eq!(parse_bytes(" 1.5T "), Some(3 << 39));
        for bad in ["", "G", "-1G", "12X", "one"] {
            assert_eq!(parse_bytes(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn charges_and_releases_on_the_allocating_thread() {
        let base = live_bytes();
        reset_peak();
        let a = Buffer::zeros(100);
        let b = a.clone();
        assert_eq!(live_bytes(), base + 800);
        drop(a);
        assert_eq!(live_bytes(), base + 400);
        assert_eq!(peak_bytes(), base + 800);
        // Dropped on another thread: still released from this thread's counter.
        std::thread::spawn(move || {
            let before = live_bytes();
            drop(b);
            assert_eq!(live_bytes(), before);
        })
        .join()
        .unwrap();
        assert_eq!(live_bytes(), base);
    }

    #[test]
    fn device_bytes_are_counted_apart_from_host_bytes() {
        let (host, device) = (live_bytes(), device_live_bytes());
        reset_peak();
        let a = DeviceCharge::new(1000);
        let b = DeviceCharge::new(24);
        assert_eq!(device_live_bytes(), device + 1024);
        assert_eq!(live_bytes(), host, "device storage is not host memory");
        drop(a);
        assert_eq!(device_live_bytes(), device + 24);
        assert_eq!(device_peak_bytes(), device + 1024);
        reset_peak();
        assert_eq!(device_peak_bytes(), device + 24);
        std::thread::spawn(move || drop(b)).join().unwrap();
        assert_eq!(device_live_bytes(), device, "released from the allocating thread's account");
    }
}
