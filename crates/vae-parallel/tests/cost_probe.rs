//! The cost model's first-use probe on this machine, for real: it ends within 10 s (the CI
//! machine has 2 cores), writes its cache, and the next load reads the cache instead of
//! measuring again. A test binary of its own, so that no other test shares the cores with it.

use std::time::{Duration, Instant};

use vae_parallel::cost::probe::{self, ProbeKey};
use vae_parallel::planner::cost::DeviceProfile;

#[test]
fn the_probe_ends_within_ten_seconds_and_the_next_load_reuses_its_cache() {
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let first = probe::load_or_probe(dir.path()).unwrap();
    let took = started.elapsed();
    assert!(took <= Duration::from_secs(10), "the probe took {took:?}");

    let cache = dir.path().join(ProbeKey::current().file_name());
    assert!(cache.is_file(), "no cache at {}", cache.display());
    assert!(first.source.contains("first-use probe"), "{}", first.source);
    assert_eq!(first.cores, std::thread::available_parallelism().map_or(1, usize::from));
    assert_eq!(first.validate(), Ok(()));
    // The built-in shapes, each scaled; the memory constants as they were.
    let builtin = DeviceProfile::builtin_cpu();
    assert_eq!(first.convs.len(), builtin.convs.len());
    assert_eq!(first.conv_scratch_bytes, builtin.conv_scratch_bytes);

    let written = std::fs::metadata(&cache).unwrap().modified().unwrap();
    let started = Instant::now();
    let second = probe::load_or_probe(dir.path()).unwrap();
    assert_eq!(second, first);
    assert!(started.elapsed() < Duration::from_secs(1), "the cache was not reused: {:?}", started.elapsed());
    assert_eq!(std::fs::metadata(&cache).unwrap().modified().unwrap(), written);
}
