//! The first-use probe: on a CPU nobody calibrated, a few seconds of timing that scale the
//! built-in constants ([`DeviceProfile::builtin_cpu`], measured on one machine) to this one, so
//! that `auto` and `plan` predict in this CPU's milliseconds without `vae-parallel calibrate`
//! (which takes minutes).
//!
//! What it times, with the kernels and code paths `calibrate` uses ([`super::measure`]): one
//! convolution of each kind a decode spends its time in (2-D and 3-D; direct, Winograd F(2×2)
//! and F(4×4); pointwise) on one thread, the two Winograd F(4×4) ones again on every core,
//! GroupNorm + SiLU, attention, and the link between two local ranks. Each built-in convolution
//! rate is scaled by the ratio of the time the built-in constants predict for the probed shape
//! nearest to it (the profile's own distance: kernel, algorithm, channels) to the time
//! measured; the element-wise and attention rates are scaled the same way (which makes them
//! the measured ones), and the core count, the link and the thread scaling are the measured
//! ones (the built-in scaling where other processes held the cores while it was read). The
//! memory constants are the built-in ones: they follow the code, not the CPU. A slow CPU times
//! smaller maps, and the probe stops timing convolutions after 6 seconds, so that
//! it ends within seconds anywhere (about 3 s on a 2-vCPU Xeon).
//!
//! The result is cached per CPU in the directory of the calibrated profile
//! ([`super::default_profile_path`]: `$XDG_CONFIG_HOME/vae-parallel/`), as
//! `probed-cpu-profile-<hash>.toml`, keyed ([`ProbeKey`]) by the CPU's model name and SIMD
//! features, the instruction set the kernels run with (`VAE_CPU_ISA`), the core count and this
//! crate's version: a file whose key differs is not used, and the probe runs again. Within a
//! process the profile is found once ([`probed_profile`]).
//!
//! `VAE_COST_PROBE=0` (or `off`, `false`, `no`) turns the probe off: the built-in constants as
//! they are. A calibrated profile at the default place wins over both
//! ([`super::load_profile`]).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use vae_planner::cost::{DeviceKind, DeviceProfile};
use vae_tensor::memory::Account;

use super::measure::{self, ConvShape, MeasureError, Timing};

/// The environment variable that turns the probe off (`0`, `off`, `false`, `no`).
pub const ENV: &str = "VAE_COST_PROBE";

/// The convolutions timed: one of each kind the image and video decoders spend their time in,
/// each a shape the built-in constants hold. Every built-in shape is scaled as its nearest
/// among these.
const PROBED: &[ConvShape] = &[
    ([1, 3, 3], 4, 256, 256),
    ([1, 3, 3], 2, 512, 512),
    ([1, 3, 3], 1, 512, 512),
    ([1, 1, 1], 1, 512, 256),
    ([3, 3, 3], 4, 192, 192),
    ([3, 3, 3], 2, 384, 384),
    ([3, 3, 3], 1, 384, 384),
];

/// The multiply-adds of one probed convolution call on one thread: maps of 32–176 px, large
/// enough that packing or transforming the weights is a small part of a call, as on a
/// decoder's maps.
const CONV_BUDGET: f64 = 4e9;
/// The first, rough measurement's multiply-adds: how fast this CPU is against the built-in
/// constants, before any map is sized.
const PILOT_BUDGET: f64 = 0.25e9;
/// The most seconds a timed call should take: a slower CPU times smaller maps, and a shape is
/// timed as the best of as many calls (up to three, after a warm-up one) as fit in twice that.
const CALL_S: f64 = 0.15;
/// After this many seconds the probe stops timing convolutions (a kind not yet timed is scaled
/// as the nearest timed one) and keeps the built-in thread scaling: a probe ends within seconds
/// on any CPU.
const DEADLINE_S: f64 = 6.0;
/// The share of every core's time a multi-thread run must get (the process's CPU time over
/// cores × wall time; about 0.75 on an idle machine, the inputs being made on one thread) for
/// its thread scaling to be read as this CPU's.
const CORES_HELD: f64 = 0.55;
/// The GroupNorm + SiLU map's side (128 channels), as `calibrate` times it, on a CPU fast enough.
const NORM_SIDE: usize = 256;
/// Attention's tokens (512 channels).
const ATTENTION_TOKENS: usize = 2048;

/// Whether the probe may run: `VAE_COST_PROBE` is not `0`, `off`, `false` or `no` (in this
/// crate's own unit tests, only where it is set).
pub fn enabled() -> bool {
    match std::env::var(ENV) {
        Ok(v) => !matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "off" | "false" | "no"),
        Err(_) => !cfg!(test),
    }
}

/// What a probed profile holds for: another CPU, instruction set, core count or version of
/// this crate is probed again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeKey {
    /// The CPU's model name and the SIMD features the kernels choose from.
    pub cpu: String,
    /// The instruction set the CPU kernels run with (`avx512`, `avx2`, `portable`).
    pub isa: String,
    /// The cores the ranks of this host share.
    pub cores: usize,
    /// This crate's version (its kernels).
    pub version: String,
}

impl ProbeKey {
    /// This process's key (read once).
    pub fn current() -> Self {
        static KEY: OnceLock<ProbeKey> = OnceLock::new();
        KEY.get_or_init(|| Self {
            cpu: measure::cpu_name(),
            isa: vae_tensor::cpu_isa_name().to_string(),
            cores: cores(),
            version: env!("CARGO_PKG_VERSION").to_string(),
        })
        .clone()
    }

    /// The cache file's name for this key: `probed-cpu-profile-<16 hex digits>.toml`, a hash of
    /// every field (FNV-1a, the same on every platform and Rust version).
    pub fn file_name(&self) -> String {
        let text = format!("{}\n{}\n{}\n{}", self.cpu, self.isa, self.cores, self.version);
        let hash = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        format!("probed-cpu-profile-{hash:016x}.toml")
    }
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// The cache file: the key it holds for, then the profile.
#[derive(Debug, Serialize, Deserialize)]
struct CacheFile {
    key: ProbeKey,
    profile: DeviceProfile,
}

/// The directory the probe's cache goes in: the calibrated profile's (None without
/// `XDG_CONFIG_HOME` or `HOME`).
pub fn cache_dir() -> Option<PathBuf> {
    super::default_profile_path(DeviceKind::Cpu).and_then(|p| p.parent().map(Path::to_path_buf))
}

/// The cached profile in `dir` for `key`, if one is there, holds for `key` and is usable (a
/// file that is not is logged and passed over).
pub fn read_cached(dir: &Path, key: &ProbeKey) -> Option<DeviceProfile> {
    let path = dir.join(key.file_name());
    let text = std::fs::read_to_string(&path).ok()?;
    let cached: CacheFile = match toml::from_str(&text) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(path = %path.display(), "a probed profile that cannot be read, probed again: {e}");
            return None;
        }
    };
    if cached.key != *key {
        tracing::debug!(path = %path.display(), "the probed profile is another CPU's; probed again");
        return None;
    }
    match cached.profile.validate() {
        Ok(()) => Some(cached.profile),
        Err(e) => {
            tracing::warn!(path = %path.display(), "a probed profile with impossible constants, probed again: {e}");
            None
        }
    }
}

/// Writes `profile` as the cache for `key` in `dir` (created if needed), atomically: a reader
/// sees the old file or the new one, whole.
pub fn write_cached(dir: &Path, key: &ProbeKey, profile: &DeviceProfile) -> Result<PathBuf, String> {
    let file = CacheFile { key: key.clone(), profile: profile.clone() };
    let text = toml::to_string_pretty(&file).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(key.file_name());
    crate::output::write_atomically(&path, text.as_bytes()).map_err(|e| e.to_string())?;
    Ok(path)
}

/// The profile for this CPU: the cache in `dir` where it holds for this process's key, else a
/// probe, written to `dir` (a probe that cannot be written is still returned, with a warning).
pub fn load_or_probe(dir: &Path) -> Result<DeviceProfile, MeasureError> {
    let key = ProbeKey::current();
    if let Some(profile) = read_cached(dir, &key) {
        tracing::debug!(dir = %dir.display(), "cost model: this CPU's probed profile, cached");
        return Ok(profile);
    }
    let profile = probe()?;
    match write_cached(dir, &key, &profile) {
        Ok(path) => tracing::info!(path = %path.display(), "cost model: the probed profile, cached"),
        Err(e) => tracing::warn!("cost model: the probed profile could not be cached ({e}); probed again next time"),
    }
    Ok(profile)
}

/// The built-in constants scaled to this CPU (see the module's description). Runs on threads
/// of its own, so that neither the caller's tensor account nor its precision scopes see it.
pub fn probe() -> Result<DeviceProfile, MeasureError> {
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("vae-cost-probe".into())
            .spawn_scoped(s, || {
                let _own = Account::new().enter();
                probe_here()
            })
            .map_err(|e| MeasureError::Rank(format!("the probe's thread: {e}")))?
            .join()
            .map_err(|_| MeasureError::Rank("the probe panicked".into()))?
    })
}

/// One probed convolution: its shape and how much faster than the built-in constants predict
/// it ran (above 1: faster).
#[derive(Debug, Clone, Copy)]
struct Speed {
    shape: ConvShape,
    speed: f64,
}

/// The geometric mean of the speeds measured so far (1 without any).
fn typical(speeds: &[Speed]) -> f64 {
    if speeds.is_empty() {
        return 1.0;
    }
    (speeds.iter().map(|s| s.speed.ln()).sum::<f64>() / speeds.len() as f64).exp()
}

fn probe_here() -> Result<DeviceProfile, MeasureError> {
    let started = Instant::now();
    let late = || started.elapsed().as_secs_f64() > DEADLINE_S;
    let builtin = DeviceProfile::builtin_cpu();
    let cores = cores();
    tracing::info!(cores, isa = vae_tensor::cpu_isa_name(), "cost model: probing this CPU (once; {ENV}=0 skips it)");
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
    let timing = Timing::CPU;
    // A convolution's map for about `budget` multiply-adds, no larger than one whose call
    // would take `most` seconds at `speed`; the built-in constants' seconds for it.
    let sized = |shape: &ConvShape, budget: f64, speed: f64, most: f64| {
        let side = measure::side_for(shape, budget, 1, timing.sides, timing.multiple);
        let expected = predicted_conv_s(&builtin, shape, side) / speed;
        let side = measure::side_for(shape, budget * (most / expected).min(1.0), 1, timing.sides, timing.multiple);
        (side, predicted_conv_s(&builtin, shape, side))
    };

    // Each kind of convolution on one thread, against the built-in constants' time for it,
    // after a pilot on a small map that says how fast this CPU is.
    let (side, predicted) = sized(&PROBED[0], PILOT_BUDGET, 1.0, CALL_S);
    let (pilot, _) = one.install(|| measure::conv_call(&Timing { reps: 1, ..timing }, &PROBED[0], (side, 1), 1))?;
    let pilot = predicted / pilot;
    let mut speeds: Vec<Speed> = Vec::with_capacity(PROBED.len());
    for shape in PROBED {
        if late() {
            tracing::debug!(?shape, "cost model probe: out of time; scaled as the nearest timed shape");
            continue;
        }
        let speed = if speeds.is_empty() { pilot } else { typical(&speeds) };
        let (side, predicted) = sized(shape, CONV_BUDGET, speed, CALL_S);
        let reps = (2.0 * CALL_S / (predicted / speed)).clamp(1.0, 3.0) as usize;
        let (seconds, _) = one.install(|| measure::conv_call(&Timing { reps, ..timing }, shape, (side, 1), 1))?;
        let speed = predicted / seconds;
        tracing::debug!(?shape, side, seconds, predicted, speed, "cost model probe: convolution");
        speeds.push(Speed { shape: *shape, speed });
    }
    if speeds.is_empty() {
        speeds.push(Speed { shape: PROBED[0], speed: pilot });
    }
    let speed = typical(&speeds);

    // Thread scaling: the 2-D and 3-D Winograd F(4×4) convolutions on one thread and on every
    // core, at maps with work for every core, pooled (one thread, every core, one thread, every
    // core: the best of each, so that a slow spell of a shared machine does not read as
    // scaling). Where the threads did not get the cores (other processes had them: the
    // process's CPU time fell short of every core for the run's wall time), the reading says
    // nothing of this CPU, and the built-in scaling stays.
    let (mut efficiency, mut efficiency_3d) = (builtin.thread_efficiency, builtin.thread_efficiency_3d);
    if cores > 1 && !late() {
        let many = rayon::ThreadPoolBuilder::new().num_threads(cores).build()?;
        let once = Timing { reps: 1, ..timing };
        let [mut single, mut multi, mut wall, mut cpu] = [0.0; 4];
        for shape in [&PROBED[0], &PROBED[4]] {
            let (side, _) = sized(shape, CONV_BUDGET * cores.min(8) as f64, speed, 2.0 * CALL_S);
            let [mut s, mut m] = [f64::INFINITY; 2];
            for _ in 0..2 {
                s = s.min(one.install(|| measure::conv_call(&once, shape, (side, 1), 1))?.0);
                let (t, c) = (Instant::now(), process_cpu_s());
                m = m.min(many.install(|| measure::conv_call(&once, shape, (side, 1), 1))?.0);
                wall += t.elapsed().as_secs_f64();
                cpu += process_cpu_s() - c;
            }
            (single, multi) = (single + s, multi + m);
        }
        let e = ((single / multi - 1.0) / (cores - 1) as f64).clamp(0.0, 1.0);
        let share = cpu / (wall * cores as f64);
        if share.is_finite() && share < CORES_HELD {
            tracing::info!(
                share,
                measured = e,
                "cost model probe: other processes held the cores; the built-in thread scaling"
            );
        } else {
            tracing::debug!(single, multi, share, efficiency = e, "cost model probe: thread scaling");
            (efficiency, efficiency_3d) = (e, None);
        }
    }

    // GroupNorm + SiLU and attention on one thread, as `calibrate` times them (smaller where
    // this CPU is slow), and the link between two local ranks.
    let norm_side = if speed >= 0.25 { NORM_SIDE } else { NORM_SIDE / 2 };
    let elementwise_gbps = one.install(|| measure::norm_silu_gbps(&timing, norm_side, 1))?;
    let tokens = if speed >= 0.25 { ATTENTION_TOKENS } else { ATTENTION_TOKENS / 2 };
    let attention_gmacs = one.install(|| measure::attention_gmacs(&Timing { reps: 1, ..timing }, tokens, 1))?;
    let (link_latency_us, link_gbps) = measure::link()?;

    let mut profile = scaled(&builtin, &speeds);
    let seconds = started.elapsed().as_secs_f64();
    profile.device = format!("cpu: {} [{}]", measure::cpu_name(), vae_tensor::cpu_isa_name());
    profile.source = format!(
        "first-use probe ({seconds:.1} s, vae-parallel {}): the built-in constants scaled to this CPU; \
         run `vae-parallel calibrate` to measure every shape",
        env!("CARGO_PKG_VERSION")
    );
    profile.cores = cores;
    profile.threads = cores;
    profile.thread_efficiency = efficiency;
    profile.thread_efficiency_3d = efficiency_3d;
    profile.elementwise_gbps = elementwise_gbps;
    profile.attention_gmacs = attention_gmacs;
    profile.link_latency_us = link_latency_us;
    profile.link_gbps = link_gbps;
    tracing::info!(
        seconds,
        efficiency,
        elementwise_gbps,
        attention_gmacs,
        speeds = ?speeds.iter().map(|s| (s.shape, (s.speed * 100.0).round() / 100.0)).collect::<Vec<_>>(),
        "cost model: probed this CPU"
    );
    profile.validate().map_err(MeasureError::Impossible)?;
    Ok(profile)
}

/// Seconds of CPU time this process has used (user and system); NaN where the platform does
/// not say.
fn process_cpu_s() -> f64 {
    #[cfg(unix)]
    {
        let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: `getrusage` fills the struct it is given and returns 0 when it did.
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } == 0 {
            // SAFETY: filled by the successful call above.
            let usage = unsafe { usage.assume_init() };
            let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
            return seconds(usage.ru_utime) + seconds(usage.ru_stime);
        }
    }
    f64::NAN
}

/// The built-in constants' seconds for one call of `shape` producing `side`² positions on one
/// thread.
fn predicted_conv_s(profile: &DeviceProfile, &(kernel, align, cin, cout): &ConvShape, side: usize) -> f64 {
    let Some(rate) = profile.conv_rate(kernel, align, cin, cout) else { return f64::NAN };
    let (fixed, rest) = profile.conv_call_s(rate, kernel, [cin, cout], (side * side) as f64);
    fixed + rest
}

/// `builtin` with every convolution's rate (and times, where it has them) scaled by the speed
/// of the probed shape nearest to it.
fn scaled(builtin: &DeviceProfile, speeds: &[Speed]) -> DeviceProfile {
    // The probed shapes as a profile, for the profile's own notion of the nearest shape.
    let probed = DeviceProfile {
        convs: speeds
            .iter()
            .map(|s| {
                let (kernel, align, in_channels, out_channels) = s.shape;
                vae_planner::cost::ConvRate {
                    kernel,
                    align,
                    in_channels,
                    out_channels,
                    gmacs: s.speed,
                    call_us: 0.0,
                    times: Vec::new(),
                }
            })
            .collect(),
        ..builtin.clone()
    };
    let mut out = builtin.clone();
    for conv in &mut out.convs {
        let speed = probed
            .conv_rate(conv.kernel, conv.align, conv.in_channels, conv.out_channels)
            .map(|nearest| nearest.gmacs)
            .filter(|s| s.is_finite() && *s > 0.0)
            .unwrap_or(1.0);
        conv.gmacs *= speed;
        conv.call_us /= speed;
        for [_, seconds] in &mut conv.times {
            *seconds /= speed;
        }
    }
    out
}

/// This process's profile for a CPU nobody calibrated, found once: the built-in constants
/// where the probe is off ([`enabled`]); else the probe's cache for this CPU, or a probe
/// (seconds, cached for the next process); the built-in constants if the probe fails (logged).
pub fn probed_profile() -> &'static DeviceProfile {
    PROFILE.get_or_init(|| {
        if !enabled() {
            tracing::debug!("cost model: {ENV} is off; the built-in constants");
            return DeviceProfile::builtin_cpu();
        }
        let found = match cache_dir() {
            Some(dir) => load_or_probe(&dir),
            None => {
                tracing::warn!("cost model: no XDG_CONFIG_HOME or HOME to cache the probe in; probed every run");
                probe()
            }
        };
        found.unwrap_or_else(|e| {
            tracing::warn!("cost model: the probe failed ({e}); the built-in constants");
            DeviceProfile::builtin_cpu()
        })
    })
}

/// [`probed_profile`] where it needs no measuring: the one this process found, or this CPU's
/// cache (then kept for the process), or the built-in constants where the probe is off. None
/// where only a probe would find it.
pub fn ready_profile() -> Option<&'static DeviceProfile> {
    if let Some(found) = PROFILE.get() {
        return Some(found);
    }
    if !enabled() {
        return Some(probed_profile());
    }
    let cached = read_cached(&cache_dir()?, &ProbeKey::current())?;
    Some(PROFILE.get_or_init(|| cached))
}

/// The profile [`probed_profile`] found.
static PROFILE: OnceLock<DeviceProfile> = OnceLock::new();

#[cfg(test)]
mod tests {
    use super::*;

    fn speed(shape: ConvShape, speed: f64) -> Speed {
        Speed { shape, speed }
    }

    #[test]
    fn each_builtin_shape_takes_the_speed_of_its_nearest_probed_kind() {
        let builtin = DeviceProfile::builtin_cpu();
        let speeds = [
            speed(([1, 3, 3], 4, 256, 256), 0.5),
            speed(([1, 3, 3], 1, 512, 512), 2.0),
            speed(([3, 3, 3], 4, 192, 192), 0.25),
        ];
        let out = scaled(&builtin, &speeds);
        let rate = |p: &DeviceProfile, kernel, align, cin, cout| p.conv_rate(kernel, align, cin, cout).unwrap().gmacs;
        let ratio =
            |kernel, align, cin, cout| rate(&out, kernel, align, cin, cout) / rate(&builtin, kernel, align, cin, cout);
        // Winograd F(4×4) 2-D shapes, whatever their channels, follow the probed one.
        assert!((ratio([1, 3, 3], 4, 128, 3) - 0.5).abs() < 1e-12);
        assert!((ratio([1, 3, 3], 4, 512, 512) - 0.5).abs() < 1e-12);
        // Direct 2-D ones the direct probe; 3-D Winograd the 3-D probe.
        assert!((ratio([1, 3, 3], 1, 16, 512) - 2.0).abs() < 1e-12);
        assert!((ratio([3, 3, 3], 4, 96, 96) - 0.25).abs() < 1e-12);
        // Everything else is the built-in profile's.
        assert_eq!(out.elementwise_gbps, builtin.elementwise_gbps);
        assert_eq!(out.conv_scratch_bytes, builtin.conv_scratch_bytes);
        assert_eq!(out.convs.len(), builtin.convs.len());
        // A measured shape's predicted time scales by its speed exactly.
        let shape = ([1, 3, 3], 4, 256, 256);
        let (before, after) = (predicted_conv_s(&builtin, &shape, 64), predicted_conv_s(&out, &shape, 64));
        assert!((before / after - 0.5).abs() < 1e-12, "{before} {after}");
    }

    #[test]
    fn a_speed_that_is_not_a_speed_leaves_the_shape_alone() {
        let builtin = DeviceProfile::builtin_cpu();
        let out = scaled(&builtin, &[speed(([1, 3, 3], 4, 256, 256), f64::NAN)]);
        assert_eq!(out, builtin);
    }

    #[test]
    fn the_cache_holds_for_its_key_only() {
        let dir = tempfile::tempdir().unwrap();
        let key = ProbeKey { cpu: "a CPU (avx2)".into(), isa: "avx2".into(), cores: 4, version: "0.0.1".into() };
        let profile = DeviceProfile { source: "probed".into(), ..DeviceProfile::builtin_cpu() };
        assert!(read_cached(dir.path(), &key).is_none());
        let path = write_cached(dir.path(), &key, &profile).unwrap();
        assert!(path.file_name().unwrap().to_str().unwrap().starts_with("probed-cpu-profile-"));
        assert_eq!(read_cached(dir.path(), &key), Some(profile.clone()));
        // Another instruction set, core count or version: another file, not found.
        for other in [
            ProbeKey { isa: "avx512".into(), ..key.clone() },
            ProbeKey { cores: 8, ..key.clone() },
            ProbeKey { version: "0.0.2".into(), ..key.clone() },
        ] {
            assert_ne!(other.file_name(), key.file_name());
            assert!(read_cached(dir.path(), &other).is_none());
        }
        // A file under the key's name that holds another key, or garbage: passed over.
        let other = ProbeKey { cpu: "another CPU".into(), ..key.clone() };
        let text = toml::to_string_pretty(&CacheFile { key: other, profile: profile.clone() }).unwrap();
        std::fs::write(&path, text).unwrap();
        assert!(read_cached(dir.path(), &key).is_none());
        std::fs::write(&path, "key = 3").unwrap();
        assert!(read_cached(dir.path(), &key).is_none());
        // Impossible constants: passed over.
        let bad = DeviceProfile { elementwise_gbps: -1.0, ..profile };
        write_cached(dir.path(), &key, &bad).unwrap();
        assert!(read_cached(dir.path(), &key).is_none());
    }

    #[test]
    fn the_key_names_a_file_stably() {
        let key = ProbeKey { cpu: "x".into(), isa: "avx2".into(), cores: 2, version: "0.1.0".into() };
        // FNV-1a of the fields, one a line: the same name in every build.
        assert_eq!(key.file_name(), "probed-cpu-profile-32e6eb94b1372f13.toml");
    }
}
