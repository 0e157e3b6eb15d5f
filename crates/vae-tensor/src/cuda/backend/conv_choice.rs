//! Which implementation runs a convolution shape: our tensor-core kernels or one of cuDNN's
//! algorithms. The rule that keeps results bit-identical across rank counts (which of cuDNN's
//! algorithms may run at all), the choice between timed candidates, and the per-device table of
//! choices made, which is written out and read back as text so that every rank of a group (and
//! every later process) takes rank 0's choice instead of timing for itself.
//!
//! The rule: a tiled or sharded decode convolves each rank's part of a tensor, whose extents and
//! origin differ from the whole's, and is bit-identical to one rank only if every output element
//! is summed in an order that depends on its own taps alone. cuDNN's implicit and explicit GEMM
//! algorithms and its direct one compute each output as one dot product over its taps; its FFT
//! and Winograd algorithms transform tiles of the output grid, so an element's rounding depends
//! on where the grid's tiles fall, which differs between a tensor and its parts. Those, and any
//! algorithm cuDNN reports as non-deterministic (a split of the sum across blocks whose order
//! varies, or that follows the workspace), never run: they are refused for every run, not only
//! for tile-parallel ones, so that a choice made on one rank holds for any group.
//!
//! The choice is kept per layer, not per extent: a [`LayerKey`] is a convolution without its
//! batch, spatial extents and padding (channels, kernel, strides, whether the input comes in two
//! parts, storage type, TF32 mode). The ranks of a tiled or sharded run convolve tiles and bands
//! of other extents than one rank does, and a shard's haloed band with other padding than the
//! whole map (its halo rows stand where the whole's zero rows were); keyed by extent or padding,
//! each could time its own winner and a layer would run ours on one rank and cuDNN on another,
//! whose bits differ. Padding changes no output's sum under either implementation: ours is
//! bit-identical across paddings by construction (the shard tests hold it), and a padded tap is
//! a zero product that cuDNN's per-output dot products add exactly. Keyed by layer, the
//! first extent seen decides for all of them. Within a process the table is shared by every
//! thread (ranks of one process decide once, under its lock); between processes the table goes
//! as text ([`export`], [`import`]; `VAE_CUDA_CONV_CHOICES` names a file every rank reads), and a
//! process that read one times nothing: a layer the text does not name runs ours, so that every
//! process holding rank 0's text decides alike.
//!
//! A group of processes decides once, on rank 0 ([`decision`], [`Agreed`]): before a request's
//! first convolution rank 0's route (ours, forced cuDNN or `fastest`) and its whole table go to
//! every rank as text, and while the request runs every rank's convolutions follow that text
//! alone: the route rank 0 takes, and under `fastest` rank 0's choice for each layer, a layer
//! it has not decided running ours on every rank, rank 0 included. Nothing is timed while a
//! decision is followed, so ranks whose clocks or tables differ cannot disagree mid-request;
//! timing happens in one-process groups (whose ranks share the table under its lock) and in
//! `calibrate`. The other ranks also import rank 0's choices into their table, so that they
//! hold them afterwards (and, having imported, time nothing themselves). A GPU profile that
//! `calibrate --model` wrote carries a table too, imported when it is loaded. None of this has
//! run on a GPU: it is tested against the fake driver and fake cuDNN of `cargo xtask gpu-emu`.
//!
//! With cuDNN forced (`ConvKernels::Cudnn`), the algorithm is the first of
//! [`PREFERENCE`] that cuDNN offers and the rule admits, not its heuristics' favourite (which may
//! differ between extents and devices); it too is kept per layer.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use super::select::ConvRoute;
use crate::DType;
use crate::abi::ConvGeom;

/// cuDNN's `cudnnConvolutionFwdAlgo_t` values this module names.
pub(crate) mod algo {
    /// `CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM`.
    pub(crate) const IMPLICIT_GEMM: u32 = 0;
    /// `CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM`.
    pub(crate) const IMPLICIT_PRECOMP_GEMM: u32 = 1;
    /// `CUDNN_CONVOLUTION_FWD_ALGO_GEMM`.
    pub(crate) const GEMM: u32 = 2;
    /// `CUDNN_CONVOLUTION_FWD_ALGO_DIRECT`.
    pub(crate) const DIRECT: u32 = 3;
    /// `CUDNN_CONVOLUTION_FWD_ALGO_FFT`.
    pub(crate) const FFT: u32 = 4;
    /// `CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING`.
    pub(crate) const FFT_TILING: u32 = 5;
    /// `CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD`.
    pub(crate) const WINOGRAD: u32 = 6;
    /// `CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED`.
    pub(crate) const WINOGRAD_NONFUSED: u32 = 7;
}

/// Why a cuDNN algorithm may not run, or `None` when it may (see the module doc).
pub(crate) fn refusal(algorithm: u32, deterministic: bool) -> Option<&'static str> {
    match algorithm {
        algo::FFT | algo::FFT_TILING => Some("an FFT over tiles of the output: rounding depends on the tile grid"),
        algo::WINOGRAD | algo::WINOGRAD_NONFUSED => {
            Some("a Winograd transform of output tiles: rounding depends on the tile grid")
        }
        algo::IMPLICIT_GEMM | algo::IMPLICIT_PRECOMP_GEMM | algo::GEMM | algo::DIRECT if !deterministic => {
            Some("cuDNN reports it non-deterministic")
        }
        algo::IMPLICIT_GEMM | algo::IMPLICIT_PRECOMP_GEMM | algo::GEMM | algo::DIRECT => None,
        _ => Some("an algorithm this build does not know"),
    }
}

/// One algorithm cuDNN offers for a shape (`cudnnConvolutionFwdAlgoPerf_t`, its status success).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Candidate {
    /// The `cudnnConvolutionFwdAlgo_t`.
    pub(crate) algorithm: u32,
    /// Workspace bytes it needs.
    pub(crate) workspace: usize,
    /// Whether cuDNN reports it deterministic.
    pub(crate) deterministic: bool,
}

/// The order forced cuDNN takes algorithms in: the precomputed-index implicit GEMM, the implicit
/// GEMM, the explicit GEMM, the direct convolution.
pub(crate) const PREFERENCE: [u32; 4] = [algo::IMPLICIT_PRECOMP_GEMM, algo::IMPLICIT_GEMM, algo::GEMM, algo::DIRECT];

/// Forced cuDNN's algorithm among `offered`: the first of [`PREFERENCE`] offered and admitted.
pub(crate) fn preferred(offered: &[Candidate]) -> Option<Candidate> {
    let allowed = admissible(offered);
    PREFERENCE.iter().find_map(|&a| allowed.iter().find(|c| c.algorithm == a).copied())
}

/// The candidates that may run, in cuDNN's order (its heuristics' best first).
pub(crate) fn admissible(candidates: &[Candidate]) -> Vec<Candidate> {
    candidates.iter().copied().filter(|c| refusal(c.algorithm, c.deterministic).is_none()).collect()
}

/// What runs a convolution shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum ConvChoice {
    /// Our tensor-core kernels (`conv.rs`).
    Ours,
    /// cuDNN's algorithm of this `cudnnConvolutionFwdAlgo_t`.
    Cudnn(u32),
}

impl std::fmt::Display for ConvChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Ours => f.write_str("ours"),
            Self::Cudnn(a) => write!(f, "cudnn:{a}"),
        }
    }
}

impl std::str::FromStr for ConvChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "ours" {
            return Ok(Self::Ours);
        }
        let algorithm = s
            .strip_prefix("cudnn:")
            .and_then(|a| a.parse::<u32>().ok())
            .ok_or_else(|| format!("{s:?} is neither `ours` nor `cudnn:<algorithm>`"))?;
        match refusal(algorithm, true) {
            None => Ok(Self::Cudnn(algorithm)),
            Some(why) => Err(format!("cuDNN algorithm {algorithm} may not run: {why}")),
        }
    }
}

/// The fastest of timed candidates: the least seconds, ties (and times that are not numbers) to
/// our kernels, then to cuDNN's earlier candidate.
pub(crate) fn fastest(ours: f64, cudnn: &[(u32, f64)]) -> ConvChoice {
    let mut best = (ConvChoice::Ours, ours);
    for &(algorithm, seconds) in cudnn {
        if seconds < best.1 || (best.1.is_nan() && !seconds.is_nan()) {
            best = (ConvChoice::Cudnn(algorithm), seconds);
        }
    }
    best.0
}

/// A convolution layer as the choice table keys it: the geometry without the batch, the spatial
/// extents and the padding (see the module doc), whether the input comes in two parts along
/// time (`front`), the storage type, and TF32 mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct LayerKey {
    pub(crate) cin: u64,
    pub(crate) cout: u64,
    pub(crate) kernel: [u64; 3],
    pub(crate) stride: [u64; 2],
    pub(crate) front: bool,
    pub(crate) dtype: DType,
    pub(crate) tf32: bool,
}

impl LayerKey {
    /// The layer of convolution `g`.
    pub(crate) fn of(g: &ConvGeom, front: bool, dtype: DType, tf32: bool) -> Self {
        Self {
            cin: g.cin,
            cout: g.cout,
            kernel: [g.kt, g.kh, g.kw],
            stride: [g.stride_t, g.stride],
            front,
            dtype,
            tf32,
        }
    }

    /// The key's fields, space-separated: `cin cout kt kh kw stride_t stride front dtype math`.
    fn text(&self) -> String {
        let mut words: Vec<String> =
            [self.cin, self.cout].iter().chain(&self.kernel).chain(&self.stride).map(u64::to_string).collect();
        words.push(u8::from(self.front).to_string());
        words.push(self.dtype.to_string());
        words.push(if self.tf32 { "tf32" } else { "full" }.into());
        words.join(" ")
    }

    fn parse(words: &[&str]) -> Result<Self, String> {
        let [cin, cout, kt, kh, kw, st, s, front, dtype, math] = words[..] else {
            return Err(format!("{} fields, not 10", words.len()));
        };
        let n = |v: &str| v.parse::<u64>().map_err(|e| format!("{v:?}: {e}"));
        let front = match front {
            "0" => false,
            "1" => true,
            other => return Err(format!("front {other:?} is not 0 or 1")),
        };
        let dtype = match dtype {
            "f32" => DType::F32,
            "bf16" => DType::BF16,
            other => return Err(format!("dtype {other:?} is not f32 or bf16")),
        };
        let tf32 = match math {
            "tf32" => true,
            "full" => false,
            other => return Err(format!("math {other:?} is not tf32 or full")),
        };
        Ok(Self {
            cin: n(cin)?,
            cout: n(cout)?,
            kernel: [n(kt)?, n(kh)?, n(kw)?],
            stride: [n(st)?, n(s)?],
            front,
            dtype,
            tf32,
        })
    }
}

/// The choices made per device (its name: identical GPUs of one process share one table, so
/// ranks on several of them take the same choice) and shape.
type Table = HashMap<String, HashMap<LayerKey, ConvChoice>>;

/// Choices made or read, and whether any were read (after which nothing is timed).
#[derive(Default)]
struct Choices {
    table: Table,
    imported: bool,
}

impl Choices {
    /// See [`choice_for`].
    fn choose<E>(
        &mut self,
        device: &str,
        key: LayerKey,
        choose: impl FnOnce() -> Result<ConvChoice, E>,
    ) -> Result<ConvChoice, E> {
        if let Some(&c) = self.table.get(device).and_then(|t| t.get(&key)) {
            return Ok(c);
        }
        let c = if self.imported { ConvChoice::Ours } else { choose()? };
        tracing::debug!(device, layer = key.text(), choice = %c, "convolution implementation chosen");
        self.table.entry(device.to_string()).or_default().insert(key, c);
        Ok(c)
    }

    /// See [`export`].
    fn export(&self) -> String {
        let mut lines: Vec<String> = self
            .table
            .iter()
            .flat_map(|(device, layers)| layers.iter().map(move |(k, c)| format!("{device}\t{}\t{c}\n", k.text())))
            .collect();
        lines.sort();
        lines.concat()
    }

    /// See [`import`].
    fn import(&mut self, text: &str) -> Result<usize, String> {
        let mut read = Vec::new();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let fields: Vec<&str> = line.split('\t').collect();
            let [device, layer, choice] = fields[..] else {
                return Err(format!("line {}: {} tab-separated fields, not 3", i + 1, fields.len()));
            };
            let words: Vec<&str> = layer.split_whitespace().collect();
            let key = LayerKey::parse(&words).map_err(|e| format!("line {}: {e}", i + 1))?;
            let choice = choice.parse::<ConvChoice>().map_err(|e| format!("line {}: {e}", i + 1))?;
            read.push((device.to_string(), key, choice));
        }
        let n = read.len();
        self.imported = true;
        for (device, key, choice) in read {
            self.table.entry(device).or_default().insert(key, choice);
        }
        Ok(n)
    }
}

fn table() -> &'static Mutex<Choices> {
    static TABLE: OnceLock<Mutex<Choices>> = OnceLock::new();
    TABLE.get_or_init(Default::default)
}

/// The environment variable naming a file of choices ([`export`]'s text) every process of a
/// group reads before its first convolution under `ConvKernels::Fastest`.
pub const CHOICES_ENV: &str = "VAE_CUDA_CONV_CHOICES";

/// Reads [`CHOICES_ENV`]'s file once per process; an unreadable or malformed file is an error
/// every time it is asked (a group must not run on choices some ranks lack).
fn load_env_choices() -> Result<(), String> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let Some(path) = std::env::var_os(CHOICES_ENV).filter(|p| !p.is_empty()) else { return Ok(()) };
            let shown = std::path::Path::new(&path).display().to_string();
            let text = std::fs::read_to_string(&path).map_err(|e| format!("{CHOICES_ENV}={shown}: {e}"))?;
            let n = import(&text).map_err(|e| format!("{CHOICES_ENV}={shown}: {e}"))?;
            tracing::info!("{n} convolution choices read from {CHOICES_ENV}={shown}");
            Ok(())
        })
        .clone()
}

/// The choice for layer `key` on device `device`: under a group's decision ([`Agreed`]) rank
/// 0's, else ours, nothing timed; otherwise the process table's, else (after reading
/// [`CHOICES_ENV`]'s file, if set) made by `choose` and kept, or ours where choices were
/// imported (see the module doc). The table's lock is held while `choose` runs, so that of
/// several ranks of a process asking at once one times the layer and the others take its choice.
pub(crate) fn choice_for(
    device: &str,
    key: LayerKey,
    choose: impl FnOnce() -> crate::Result<ConvChoice>,
) -> crate::Result<ConvChoice> {
    if let Some(c) = agreed_choice(&key) {
        return Ok(c);
    }
    load_env_choices().map_err(|reason| crate::TensorError::InvalidArgument { op: "conv3d", reason })?;
    table().lock().unwrap_or_else(|p| p.into_inner()).choose(device, key, choose)
}

/// Forced cuDNN's algorithm for layer `key` on device `device`: the first extent's
/// [`preferred`] candidate (by `choose`), kept per layer so that every tile and band of a layer
/// runs it. A table of its own, never imported.
pub(crate) fn forced_for<E>(
    device: &str,
    key: LayerKey,
    choose: impl FnOnce() -> Result<ConvChoice, E>,
) -> Result<ConvChoice, E> {
    static FORCED: OnceLock<Mutex<Choices>> = OnceLock::new();
    FORCED.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner()).choose(device, key, choose)
}

/// Rank 0's decision as a group of processes follows it ([`Agreed`]): the route its
/// convolutions take and its choice per layer, whatever device name it was made under.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Decision {
    route: ConvRoute,
    choices: HashMap<LayerKey, ConvChoice>,
}

/// The first line of a decision's text names its route.
const ROUTE_PREFIX: &str = "route\t";

impl Decision {
    /// Reads [`decision`]'s text: the route line, then choices as [`export`] writes them. A
    /// layer named under several device names takes the first line's choice (the text is
    /// sorted, so every rank reading it takes the same).
    fn parse(text: &str) -> Result<Self, String> {
        let (first, rest) = text.split_once('\n').unwrap_or((text, ""));
        let route = match first.strip_prefix(ROUTE_PREFIX) {
            Some("ours") => ConvRoute::Ours,
            Some("cudnn") => ConvRoute::Cudnn,
            Some("fastest") => ConvRoute::Fastest,
            _ => return Err(format!("a decision starts with `route<TAB>ours|cudnn|fastest`, not {first:?}")),
        };
        let mut read = Choices::default();
        read.import(rest)?;
        let mut choices = HashMap::new();
        let mut lines: Vec<(&String, &LayerKey, &ConvChoice)> =
            read.table.iter().flat_map(|(d, layers)| layers.iter().map(move |(k, c)| (d, k, c))).collect();
        lines.sort_by(|a, b| (a.0, a.1.text()).cmp(&(b.0, b.1.text())));
        for (_, &key, &choice) in lines {
            choices.entry(key).or_insert(choice);
        }
        Ok(Self { route, choices })
    }

    /// The choice for `key` under this decision: rank 0's, else ours.
    fn choice(&self, key: &LayerKey) -> ConvChoice {
        self.choices.get(key).copied().unwrap_or(ConvChoice::Ours)
    }
}

thread_local! {
    /// The decision the calling thread's convolutions follow ([`Agreed`]).
    static AGREED: std::cell::RefCell<Option<std::rc::Rc<Decision>>> = const { std::cell::RefCell::new(None) };
}

/// The route of the decision the calling thread follows, if it follows one.
pub(super) fn agreed_route() -> Option<ConvRoute> {
    AGREED.with_borrow(|d| d.as_ref().map(|d| d.route))
}

/// Rank 0's choice for layer `key` where the calling thread follows a decision (ours for a
/// layer it did not decide).
pub(super) fn agreed_choice(key: &LayerKey) -> Option<ConvChoice> {
    AGREED.with_borrow(|d| d.as_ref().map(|d| d.choice(key)))
}

/// The calling thread's part of its group's decision: rank 0's text ([`decision`]), its
/// route and choices followed by this thread's convolutions while this lives. Guards nest;
/// the previous decision (or none) returns when one ends.
pub(crate) struct Agreed {
    previous: Option<std::rc::Rc<Decision>>,
}

impl Agreed {
    /// Follows `text` on the calling thread; with `hold`, also imports its choices into the
    /// process's table (the other ranks: they hold rank 0's choices afterwards). A malformed
    /// text changes nothing.
    pub(crate) fn enter(text: &str, hold: bool) -> Result<Self, String> {
        let decision = Decision::parse(text)?;
        if hold && !decision.choices.is_empty() {
            let rest = text.split_once('\n').map_or("", |(_, rest)| rest);
            let n = import(rest)?;
            tracing::info!("{n} convolution choices of rank 0 taken");
        }
        Ok(Self { previous: AGREED.replace(Some(std::rc::Rc::new(decision))) })
    }
}

impl Drop for Agreed {
    fn drop(&mut self) {
        AGREED.set(self.previous.take());
    }
}

/// What rank 0 of a group of processes tells the others before a request (see the module
/// doc): the calling thread's route, then the process's choices (those of
/// [`CHOICES_ENV`]'s file read first, where set). Under a decision it follows, that
/// decision's route.
pub(crate) fn decision() -> Result<String, String> {
    let route = super::select::conv_route();
    if route == ConvRoute::Fastest {
        load_env_choices()?;
    }
    let name = match route {
        ConvRoute::Ours => "ours",
        ConvRoute::Cudnn => "cudnn",
        ConvRoute::Fastest => "fastest",
    };
    Ok(format!("{ROUTE_PREFIX}{name}\n{}", export()))
}

/// The process's choices, one line each (`device<TAB>layer<TAB>choice`), sorted.
pub(crate) fn export() -> String {
    table().lock().unwrap_or_else(|p| p.into_inner()).export()
}

/// Reads choices written by [`export`] into the process's table, replacing those of the same
/// device and layer; returns how many. Nothing is read unless every line is well-formed and
/// every cuDNN algorithm named is admitted. From then on the process times nothing.
pub(crate) fn import(text: &str) -> Result<usize, String> {
    table().lock().unwrap_or_else(|p| p.into_inner()).import(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geom(cout: u64, h: u64) -> ConvGeom {
        ConvGeom {
            n: 1,
            cin: 96,
            t: 3,
            h,
            w: 11,
            cout,
            kt: 3,
            kh: 3,
            kw: 3,
            to: 3,
            ho: h,
            wo: 11,
            stride_t: 1,
            stride: 1,
            pad_front: 2,
            pad_top: 1,
            pad_left: -1,
        }
    }

    fn key(cout: u64) -> LayerKey {
        LayerKey::of(&geom(cout, 9), true, DType::BF16, false)
    }

    #[test]
    fn only_deterministic_per_output_dot_products_may_run() {
        for a in [algo::IMPLICIT_GEMM, algo::IMPLICIT_PRECOMP_GEMM, algo::GEMM, algo::DIRECT] {
            assert_eq!(refusal(a, true), None, "{a}");
            assert!(refusal(a, false).is_some_and(|w| w.contains("non-deterministic")), "{a}");
        }
        for a in [algo::FFT, algo::FFT_TILING, algo::WINOGRAD, algo::WINOGRAD_NONFUSED] {
            assert!(refusal(a, true).is_some_and(|w| w.contains("tile grid")), "{a}");
        }
        assert!(refusal(8, true).is_some());
        let c = |algorithm, deterministic| Candidate { algorithm, workspace: 0, deterministic };
        let offered = [c(algo::WINOGRAD, true), c(algo::IMPLICIT_PRECOMP_GEMM, false), c(algo::GEMM, true), c(0, true)];
        assert_eq!(admissible(&offered), [c(algo::GEMM, true), c(0, true)]);
        // Forced cuDNN takes the preference order, not cuDNN's: the implicit GEMM before GEMM.
        assert_eq!(preferred(&offered), Some(c(algo::IMPLICIT_GEMM, true)));
        assert_eq!(preferred(&[c(algo::FFT, true), c(algo::GEMM, false)]), None);
    }

    #[test]
    fn the_fastest_wins_and_ties_go_to_ours_then_the_earlier_candidate() {
        assert_eq!(fastest(2.0, &[(1, 1.0), (0, 3.0)]), ConvChoice::Cudnn(1));
        assert_eq!(fastest(1.0, &[(1, 1.0), (0, 3.0)]), ConvChoice::Ours);
        assert_eq!(fastest(2.0, &[(1, 1.5), (0, 1.5)]), ConvChoice::Cudnn(1));
        assert_eq!(fastest(f64::NAN, &[(2, 4.0)]), ConvChoice::Cudnn(2));
        assert_eq!(fastest(1.0, &[(2, f64::NAN)]), ConvChoice::Ours);
        assert_eq!(fastest(1.0, &[]), ConvChoice::Ours);
    }

    #[test]
    fn a_layer_is_chosen_once_per_device_whatever_its_extents() {
        let mut choices = Choices::default();
        let timed = std::cell::Cell::new(0);
        let choose = |c| {
            timed.set(timed.get() + 1);
            Ok::<_, ()>(c)
        };
        assert_eq!(choices.choose("gpu", key(7), || choose(ConvChoice::Cudnn(1))), Ok(ConvChoice::Cudnn(1)));
        // Another tile or band of the same layer (other rows): the same choice, not timed again.
        let band = LayerKey::of(&geom(7, 4), true, DType::BF16, false);
        assert_eq!(band, key(7));
        // A shard's haloed band: its halo rows stand where the whole map's zero rows were, so it
        // convolves with other padding; still the same layer, or ranks could choose apart.
        let haloed = LayerKey::of(&ConvGeom { pad_top: 0, pad_left: 0, ..geom(7, 6) }, true, DType::BF16, false);
        assert_eq!(haloed, key(7));
        assert_eq!(choices.choose("gpu", haloed, || choose(ConvChoice::Ours)), Ok(ConvChoice::Cudnn(1)));
        assert_eq!(choices.choose("gpu", band, || choose(ConvChoice::Ours)), Ok(ConvChoice::Cudnn(1)));
        assert_eq!(timed.get(), 1);
        // Another device name, type or math mode is another entry.
        assert_eq!(choices.choose("gpu-2", key(7), || choose(ConvChoice::Ours)), Ok(ConvChoice::Ours));
        let tf32 = LayerKey { tf32: true, dtype: DType::F32, ..key(7) };
        assert_eq!(choices.choose("gpu", tf32, || choose(ConvChoice::Cudnn(0))), Ok(ConvChoice::Cudnn(0)));
        assert_eq!(timed.get(), 3);
        // A failed choice is not kept.
        assert_eq!(choices.choose("gpu", key(8), || Err::<ConvChoice, _>("no")), Err("no"));
        assert_eq!(choices.choose("gpu", key(8), || Ok::<_, ()>(ConvChoice::Ours)), Ok(ConvChoice::Ours));
    }

    #[test]
    fn rank_0s_choices_reach_another_process_and_stop_its_timing() {
        let mut rank0 = Choices::default();
        rank0.choose("H200 (sm_90)", key(7), || Ok::<_, ()>(ConvChoice::Cudnn(1))).unwrap();
        rank0.choose("H200 (sm_90)", key(8), || Ok::<_, ()>(ConvChoice::Ours)).unwrap();
        let text = rank0.export();
        assert_eq!(
            text,
            "H200 (sm_90)\t96 7 3 3 3 1 1 1 bf16 full\tcudnn:1\nH200 (sm_90)\t96 8 3 3 3 1 1 1 bf16 full\tours\n"
        );
        let mut rank1 = Choices::default();
        // What it had timed itself is replaced by rank 0's.
        rank1.choose("H200 (sm_90)", key(7), || Ok::<_, ()>(ConvChoice::Ours)).unwrap();
        assert_eq!(rank1.import(&text), Ok(2));
        let never = || -> Result<ConvChoice, ()> { panic!("a process that read rank 0's choices times nothing") };
        assert_eq!(rank1.choose("H200 (sm_90)", key(7), never), Ok(ConvChoice::Cudnn(1)));
        // A layer rank 0 did not name runs ours on every rank.
        assert_eq!(rank1.choose("H200 (sm_90)", key(9), never), Ok(ConvChoice::Ours));
        assert_eq!(rank1.export().lines().count(), 3);
    }

    #[test]
    fn a_thread_following_rank_0s_decision_takes_its_route_and_choices_and_times_nothing() {
        let mut rank0 = Choices::default();
        rank0.choose("H200 (sm_90)", key(7), || Ok::<_, ()>(ConvChoice::Cudnn(1))).unwrap();
        // A second device name naming the same layer otherwise: the sorted text's first wins.
        rank0.choose("A100 (sm_80)", key(7), || Ok::<_, ()>(ConvChoice::Cudnn(0))).unwrap();
        let text = format!("route\tfastest\n{}", rank0.export());
        let never = || -> crate::Result<ConvChoice> { panic!("nothing is timed under a decision") };
        assert_eq!(agreed_route(), None);
        {
            let _agreed = Agreed::enter(&text, false).unwrap();
            assert_eq!(agreed_route(), Some(ConvRoute::Fastest));
            assert_eq!(super::super::select::conv_route(), ConvRoute::Fastest);
            // Rank 0's choice whatever this rank's device is called; a layer it did not decide: ours.
            assert_eq!(choice_for("another GPU", key(7), never).unwrap(), ConvChoice::Cudnn(0));
            assert_eq!(choice_for("H200 (sm_90)", key(9), never).unwrap(), ConvChoice::Ours);
            {
                let _ours = Agreed::enter("route\tours\n", false).unwrap();
                assert_eq!(super::super::select::conv_route(), ConvRoute::Ours);
                assert_eq!(choice_for("H200 (sm_90)", key(7), never).unwrap(), ConvChoice::Ours);
            }
            assert_eq!(agreed_route(), Some(ConvRoute::Fastest));
        }
        assert_eq!(agreed_route(), None);
        // What is not a decision changes nothing.
        for bad in ["", "fastest\n", "route\tquick\n", "route\tfastest\ngpu\t1 2\tours\n"] {
            assert!(Agreed::enter(bad, false).is_err(), "{bad:?}");
            assert_eq!(agreed_route(), None);
        }
    }

    #[test]
    fn imports_refuse_malformed_lines_and_refused_algorithms_whole() {
        let good = "gpu\t96 7 3 3 3 1 1 1 bf16 full\tours\n";
        for bad in [
            "gpu\t1 2 3\tours",
            "gpu\t96 7 3 3 3 1 1 1 f16 full\tours",
            "gpu\t96 7 3 3 3 1 1 2 bf16 full\tours",
            "gpu\t96 7 3 3 3 1 1 1 bf16 full\tcudnn:6",
            "gpu\t96 7 3 3 3 1 1 1 bf16 full\tfast",
            "gpu only two\tfields",
        ] {
            let mut choices = Choices::default();
            assert!(choices.import(&format!("{good}{bad}\n")).is_err(), "{bad}");
            assert!(choices.export().is_empty() && !choices.imported, "nothing of a refused text is kept");
        }
        assert_eq!(Choices::default().import(&format!("\n{good}\n")), Ok(1));
        assert_eq!(
            "cudnn:6".parse::<ConvChoice>().unwrap_err(),
            "cuDNN algorithm 6 may not run: a Winograd transform of output tiles: rounding depends on the tile grid"
        );
    }
}
