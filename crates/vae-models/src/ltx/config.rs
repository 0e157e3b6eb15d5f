//! `config.json` of diffusers' `AutoencoderKLLTXVideo` and `AutoencoderKLLTX2Video`, and the
//! block layout both halves derive from it, channel counts checked as the classes' reshapes
//! would check them.
//!
//! The two classes share their keywords but not their defaults, nor how the encoder's widths
//! run: LTX-Video's 0.9.5 encoder starts at `block_out_channels[0]` and has one block fewer
//! than widths, LTX-2's starts at the latent width and has one block per width.

use serde::Deserialize;

/// Which of the two classes a config is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LtxClass {
    /// `AutoencoderKLLTXVideo` (LTX-Video 0.9.5 and later).
    LtxVideo,
    /// `AutoencoderKLLTX2Video` (LTX-2).
    Ltx2,
}

impl LtxClass {
    /// The diffusers class name.
    pub const fn name(self) -> &'static str {
        match self {
            Self::LtxVideo => "AutoencoderKLLTXVideo",
            Self::Ltx2 => "AutoencoderKLLTX2Video",
        }
    }
}

/// A keyword diffusers takes as one bool or a tuple of them.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
enum Flags {
    One(bool),
    Many(Vec<bool>),
}

impl Flags {
    /// The tuple; a single bool repeated `n` times, as the LTX-2 class expands it (the LTX-Video
    /// class fails on one: it reverses the keyword).
    fn expand(&self, n: usize, class: LtxClass, what: &str) -> Result<Vec<bool>, String> {
        match self {
            Self::One(b) if class == LtxClass::Ltx2 => Ok(vec![*b; n]),
            Self::One(_) => Err(format!("{what} must be a list of bools for {}", class.name())),
            Self::Many(v) => Ok(v.clone()),
        }
    }
}

/// The keywords as `config.json` holds them (absent ones take the class's default).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawConfig {
    #[serde(rename = "_class_name")]
    class_name: Option<String>,
    in_channels: Option<usize>,
    out_channels: Option<usize>,
    latent_channels: Option<usize>,
    block_out_channels: Option<Vec<usize>>,
    down_block_types: Option<Vec<String>>,
    decoder_block_out_channels: Option<Vec<usize>>,
    layers_per_block: Option<Vec<usize>>,
    decoder_layers_per_block: Option<Vec<usize>>,
    spatio_temporal_scaling: Option<Flags>,
    decoder_spatio_temporal_scaling: Option<Flags>,
    decoder_inject_noise: Option<Flags>,
    downsample_type: Option<Vec<String>>,
    upsample_type: Option<Vec<String>>,
    upsample_residual: Option<Flags>,
    upsample_factor: Option<Vec<usize>>,
    timestep_conditioning: Option<bool>,
    patch_size: Option<usize>,
    patch_size_t: Option<usize>,
    scaling_factor: Option<f64>,
    encoder_causal: Option<bool>,
    decoder_causal: Option<bool>,
    encoder_spatial_padding_mode: Option<String>,
    decoder_spatial_padding_mode: Option<String>,
    spatial_compression_ratio: Option<usize>,
    temporal_compression_ratio: Option<usize>,
}

/// How a conv pads H and W (time is padded by repeating edge frames).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpatialPadding {
    /// `padding_mode="zeros"`.
    Zeros,
    /// `padding_mode="reflect"`: row −1 is row 1.
    Reflect,
}

impl SpatialPadding {
    fn parse(s: &str, what: &str) -> Result<Self, String> {
        match s {
            "zeros" => Ok(Self::Zeros),
            "reflect" => Ok(Self::Reflect),
            other => Err(format!("{what} {other:?} is not supported (zeros or reflect)")),
        }
    }
}

/// A resampling step's factors `[t, h, w]` (each 1 or 2, H and W alike).
pub type Stride = [usize; 3];

fn stride_of(kind: &str, what: &str) -> Result<Stride, String> {
    match kind {
        "spatial" => Ok([1, 2, 2]),
        "temporal" => Ok([2, 1, 1]),
        "spatiotemporal" => Ok([2, 2, 2]),
        "conv" => Err(format!(
            "{what} \"conv\" (a strided conv, LTX-Video before 0.9.5) is not supported; LTX-Video 0.9.5 and \
             later and LTX-2 fold pixels into channels"
        )),
        other => Err(format!("{what} {other:?} is not one of spatial, temporal, spatiotemporal")),
    }
}

/// One encoder block: resnets at `width`, then maybe a downsample to `out` channels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DownLevel {
    /// Channels of the resnets.
    pub width: usize,
    /// Resnets.
    pub layers: usize,
    /// The downsample's factors, if the block has one.
    pub down: Option<Stride>,
    /// Channels after the block.
    pub out: usize,
}

/// One decoder block: maybe an upsample to `width` channels, then resnets at `width`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpLevel {
    /// Channels entering the block.
    pub cin: usize,
    /// The upsample, if the block has one: factors, residual, and the channel reduction.
    pub up: Option<(Stride, bool, usize)>,
    /// Channels of the resnets (and after the block).
    pub width: usize,
    /// Resnets.
    pub layers: usize,
}

/// A resolved config: the class's defaults filled in, the layout derived and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct LtxConfig {
    /// The class.
    pub class: LtxClass,
    /// Video channels in.
    pub in_channels: usize,
    /// Video channels out.
    pub out_channels: usize,
    /// Latent channels.
    pub latent_channels: usize,
    /// Pixels per patch side (`patch_size`; the frames' patch is 1).
    pub patch_size: usize,
    /// Encoder: `conv_in`'s width.
    pub encoder_stem: usize,
    /// Encoder blocks.
    pub down: Vec<DownLevel>,
    /// Encoder mid-block resnets.
    pub encoder_mid_layers: usize,
    /// Decoder: `conv_in`'s width (the mid block's).
    pub decoder_stem: usize,
    /// Decoder mid-block resnets.
    pub decoder_mid_layers: usize,
    /// Decoder blocks.
    pub up: Vec<UpLevel>,
    /// Whether the decoder takes a timestep (`timestep_conditioning`).
    pub timestep_conditioning: bool,
    /// Whether the encoder's convs are causal in time.
    pub encoder_causal: bool,
    /// Whether the decoder's convs are causal in time.
    pub decoder_causal: bool,
    /// How the encoder's convs pad H and W.
    pub encoder_padding: SpatialPadding,
    /// How the decoder's convs pad H and W.
    pub decoder_padding: SpatialPadding,
    /// The pipelines' latent scale.
    pub scaling_factor: f64,
    /// `spatial_compression_ratio` as the class sets it (the config's, else its formula): what
    /// its tiling divides pixel tile sizes by.
    pub spatial_compression_ratio: usize,
    /// `temporal_compression_ratio` likewise.
    pub temporal_compression_ratio: usize,
}

impl LtxConfig {
    /// Parses `config.json` text for `class`.
    pub fn parse(text: &str, class: LtxClass) -> Result<Self, String> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if raw.class_name.as_deref() != Some(class.name()) {
            return Err(format!("_class_name {:?} is not {}", raw.class_name.unwrap_or_default(), class.name()));
        }
        Self::resolve(raw, class)
    }

    fn resolve(raw: RawConfig, class: LtxClass) -> Result<Self, String> {
        let ltx2 = class == LtxClass::Ltx2;
        let v = |x: &[usize]| x.to_vec();
        let s = |x: &[&str]| x.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let latent = raw.latent_channels.unwrap_or(128);
        let block_out = raw
            .block_out_channels
            .unwrap_or_else(|| if ltx2 { v(&[256, 512, 1024, 2048]) } else { v(&[128, 256, 512, 512]) });
        let layers =
            raw.layers_per_block.unwrap_or_else(|| if ltx2 { v(&[4, 6, 6, 2, 2]) } else { v(&[4, 3, 3, 3, 4]) });
        let down_types = raw
            .down_block_types
            .unwrap_or_else(|| vec![if ltx2 { "LTX2VideoDownBlock3D" } else { "LTXVideoDownBlock3D" }.to_string(); 4]);
        let flags = |f: Option<Flags>, n: usize, what: &str, default: Vec<bool>| match f {
            Some(f) => f.expand(n, class, what),
            None => Ok(default),
        };
        let scaling = flags(
            raw.spatio_temporal_scaling,
            layers.len().saturating_sub(1),
            "spatio_temporal_scaling",
            if ltx2 { vec![true; 4] } else { vec![true, true, true, false] },
        )?;
        let downsample = raw.downsample_type.unwrap_or_else(|| {
            if ltx2 { s(&["spatial", "temporal", "spatiotemporal", "spatiotemporal"]) } else { s(&["conv"; 4]) }
        });
        let dec_out = raw
            .decoder_block_out_channels
            .unwrap_or_else(|| if ltx2 { v(&[256, 512, 1024]) } else { v(&[128, 256, 512, 512]) });
        let dec_layers =
            raw.decoder_layers_per_block.unwrap_or_else(|| if ltx2 { v(&[5, 5, 5, 5]) } else { v(&[4, 3, 3, 3, 4]) });
        let n_dec = dec_layers.len();
        let dec_scaling = flags(
            raw.decoder_spatio_temporal_scaling,
            n_dec.saturating_sub(1),
            "decoder_spatio_temporal_scaling",
            if ltx2 { vec![true; 3] } else { vec![true, true, true, false] },
        )?;
        let noise = flags(
            raw.decoder_inject_noise,
            n_dec,
            "decoder_inject_noise",
            if ltx2 { vec![false; 4] } else { vec![false; 5] },
        )?;
        let residual = flags(
            raw.upsample_residual,
            n_dec.saturating_sub(1),
            "upsample_residual",
            if ltx2 { vec![true; 3] } else { vec![false; 4] },
        )?;
        let factor = raw.upsample_factor.unwrap_or_else(|| if ltx2 { v(&[2, 2, 2]) } else { v(&[1, 1, 1, 1]) });
        let up_types = if ltx2 {
            raw.upsample_type.unwrap_or_else(|| s(&["spatiotemporal"; 3]))
        } else {
            vec!["spatiotemporal".to_string(); dec_out.len()]
        };
        let patch = raw.patch_size.unwrap_or(4);
        let patch_t = raw.patch_size_t.unwrap_or(1);
        if patch == 0 || patch_t != 1 {
            return Err(format!(
                "patch_size {patch} / patch_size_t {patch_t}: a positive patch_size and patch_size_t 1 are supported"
            ));
        }

        // Encoder layout.
        let (stem, widths_out): (usize, Vec<usize>) = if ltx2 {
            (latent, block_out.clone())
        } else {
            if down_types.last().map(String::as_str) != Some("LTXVideo095DownBlock3D") {
                return Err(format!(
                    "down_block_types {down_types:?}: only LTX-Video 0.9.5 and later (LTXVideo095DownBlock3D) is \
                     supported, not the earlier strided-conv encoder"
                ));
            }
            let first = *block_out.first().ok_or("block_out_channels is empty")?;
            (first, block_out.get(1..).unwrap_or_default().to_vec())
        };
        let want_block = if ltx2 { "LTX2VideoDownBlock3D" } else { "LTXVideo095DownBlock3D" };
        let n = widths_out.len();
        if n == 0 || layers.len() < n + 1 || scaling.len() < n || downsample.len() < n || down_types.len() < n {
            return Err(format!(
                "encoder: {n} blocks need {} layers_per_block and {n} of down_block_types, spatio_temporal_scaling \
                 and downsample_type (got {}, {}, {}, {})",
                n + 1,
                layers.len(),
                down_types.len(),
                scaling.len(),
                downsample.len()
            ));
        }
        let mut down = Vec::with_capacity(n);
        let mut c = stem;
        for i in 0..n {
            if down_types[i] != want_block {
                return Err(format!("down_block_types[{i}] {:?} is not {want_block}", down_types[i]));
            }
            let out = widths_out[i];
            let stride =
                if scaling[i] { Some(stride_of(&downsample[i], &format!("downsample_type[{i}]"))?) } else { None };
            match stride {
                Some(st) => {
                    let k: usize = st.iter().product();
                    if out == 0 || !out.is_multiple_of(k) || !(c * k).is_multiple_of(out) {
                        return Err(format!(
                            "encoder block {i}: {k} x {c} folded channels cannot be averaged into {out}"
                        ));
                    }
                }
                None if out != c => {
                    return Err(format!("encoder block {i} keeps {c} channels but the next block expects {out}"));
                }
                None => {}
            }
            down.push(DownLevel { width: c, layers: layers[i], down: stride, out });
            c = out;
        }
        let encoder_mid_layers = *layers.last().unwrap_or(&0);

        // Decoder layout (every per-block tuple reversed, as the class reverses them).
        let widths: Vec<usize> = dec_out.iter().rev().copied().collect();
        let m = widths.len();
        if m == 0
            || dec_layers.len() < m + 1
            || noise.len() < m + 1
            || dec_scaling.len() < m
            || residual.len() < m
            || factor.len() < m
            || up_types.len() < m
        {
            return Err(format!(
                "decoder: {m} blocks need {} of decoder_layers_per_block and decoder_inject_noise and {m} of \
                 decoder_spatio_temporal_scaling, upsample_residual, upsample_factor and upsample_type",
                m + 1
            ));
        }
        // The class reverses each tuple whole, then reads its first entries; all but upsample_type,
        // which it reads in the order given.
        fn reversed<T: Clone>(x: &[T]) -> Vec<T> {
            x.iter().rev().cloned().collect()
        }
        let (dec_scaling, residual, factor) = (reversed(&dec_scaling), reversed(&residual), reversed(&factor));
        let dec_layers = reversed(&dec_layers);
        if reversed(&noise)[..=m].iter().any(|&b| b) {
            return Err(
                "decoder_inject_noise: noise injection draws from PyTorch's global generator at every call and \
                 cannot be reproduced; only configs without it are supported"
                    .into(),
            );
        }
        let decoder_stem = widths[0];
        let mut up = Vec::with_capacity(m);
        let mut output = decoder_stem;
        let mut c = decoder_stem;
        for i in 0..m {
            let u = factor[i];
            if u == 0 {
                return Err("upsample_factor must be positive".into());
            }
            let input = output / u;
            output = widths[i] / u;
            if input != output {
                return Err(format!(
                    "decoder block {i} changes channels ({input} -> {output}) before its upsample (a resnet with a \
                     LayerNorm shortcut, LTX-Video before 0.9.5); not supported"
                ));
            }
            let up_step = if dec_scaling[i] {
                let st = stride_of(&up_types[i], &format!("upsample_type[{i}]"))?;
                let k: usize = st.iter().product();
                let cin = output * u;
                if cin != c || !(cin * k).is_multiple_of(u) || !(cin * k / u).is_multiple_of(k) {
                    return Err(format!(
                        "decoder block {i}: its upsample takes {cin} channels, the block before gives {c}"
                    ));
                }
                if residual[i] && !(cin.is_multiple_of(k) && (k.is_multiple_of(u))) {
                    return Err(format!(
                        "decoder block {i}: the residual cannot repeat {cin} / {k} channels {k} / {u} times"
                    ));
                }
                Some((st, residual[i], u))
            } else {
                if c != output {
                    return Err(format!("decoder block {i} gets {c} channels, its resnets take {output}"));
                }
                None
            };
            up.push(UpLevel { cin: c, up: up_step, width: output, layers: dec_layers[i + 1] });
            c = output;
        }

        let scaled = scaling.iter().filter(|&&b| b).count() as u32;
        let spatial_ratio = raw.spatial_compression_ratio.unwrap_or(patch * 2usize.pow(scaled));
        let temporal_ratio = raw.temporal_compression_ratio.unwrap_or(patch_t * 2usize.pow(scaled));
        if spatial_ratio == 0 || temporal_ratio == 0 {
            return Err("compression ratios must be positive".into());
        }
        let padding =
            |v: Option<String>, default: &str, what: &str| SpatialPadding::parse(v.as_deref().unwrap_or(default), what);
        let config = Self {
            class,
            in_channels: raw.in_channels.unwrap_or(3),
            out_channels: raw.out_channels.unwrap_or(3),
            latent_channels: latent,
            patch_size: patch,
            encoder_stem: stem,
            down,
            encoder_mid_layers,
            decoder_stem,
            decoder_mid_layers: dec_layers[0],
            up,
            timestep_conditioning: raw.timestep_conditioning.unwrap_or(false),
            encoder_causal: raw.encoder_causal.unwrap_or(true),
            decoder_causal: raw.decoder_causal.unwrap_or(ltx2),
            encoder_padding: if ltx2 {
                padding(raw.encoder_spatial_padding_mode, "zeros", "encoder_spatial_padding_mode")?
            } else {
                SpatialPadding::Zeros
            },
            decoder_padding: if ltx2 {
                padding(raw.decoder_spatial_padding_mode, "reflect", "decoder_spatial_padding_mode")?
            } else {
                SpatialPadding::Zeros
            },
            scaling_factor: raw.scaling_factor.unwrap_or(1.0),
            spatial_compression_ratio: spatial_ratio,
            temporal_compression_ratio: temporal_ratio,
        };
        if config.in_channels == 0 || config.out_channels == 0 || latent < 2 {
            return Err("in_channels and out_channels must be positive, latent_channels at least 2".into());
        }
        Ok(config)
    }

    /// Pixels per latent pixel along H and W as the encoder computes them.
    pub fn encoder_spatial_factor(&self) -> usize {
        self.patch_size * self.down.iter().filter_map(|l| l.down).map(|s| s[1]).product::<usize>()
    }

    /// Frames per latent frame (after the first) as the encoder computes them.
    pub fn encoder_temporal_factor(&self) -> usize {
        self.down.iter().filter_map(|l| l.down).map(|s| s[0]).product()
    }

    /// Pixels per latent pixel as the decoder computes them.
    pub fn decoder_spatial_factor(&self) -> usize {
        self.patch_size * self.up.iter().filter_map(|l| l.up).map(|(s, ..)| s[1]).product::<usize>()
    }

    /// Frames per latent frame (after the first) as the decoder computes them.
    pub fn decoder_temporal_factor(&self) -> usize {
        self.up.iter().filter_map(|l| l.up).map(|(s, ..)| s[0]).product()
    }

    /// The decoder's last width (`conv_out`'s input).
    pub fn decoder_last_width(&self) -> usize {
        self.up.last().map_or(self.decoder_stem, |l| l.width)
    }

    /// The encoder's last width (the mid block's).
    pub fn encoder_last_width(&self) -> usize {
        self.down.last().map_or(self.encoder_stem, |l| l.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str, class: LtxClass) -> Result<LtxConfig, String> {
        LtxConfig::parse(json, class)
    }

    #[test]
    fn the_ltx2_defaults_are_its_published_layout() {
        let c = parse(r#"{"_class_name": "AutoencoderKLLTX2Video"}"#, LtxClass::Ltx2).unwrap();
        assert_eq!(c.encoder_stem, 128);
        assert_eq!(c.down.iter().map(|l| l.out).collect::<Vec<_>>(), [256, 512, 1024, 2048]);
        assert_eq!(c.down[0].down, Some([1, 2, 2]));
        assert_eq!(c.encoder_spatial_factor(), 32);
        assert_eq!(c.encoder_temporal_factor(), 8);
        assert_eq!((c.decoder_spatial_factor(), c.decoder_temporal_factor()), (32, 8));
        assert_eq!(c.decoder_stem, 1024);
        assert_eq!(c.up.iter().map(|l| l.width).collect::<Vec<_>>(), [512, 256, 128]);
        assert_eq!(c.decoder_padding, SpatialPadding::Reflect);
        // The class's formula counts every scaling flag: 4 · 2⁴, not the 32 the blocks make.
        assert_eq!(c.spatial_compression_ratio, 64);
        assert!(c.decoder_causal, "the class's default is causal; published configs say otherwise");
    }

    /// The class reverses each decoder tuple whole and reads its first entries, so a tuple longer
    /// than the blocks loses its first entries, not its last; upsample_type is read as given.
    #[test]
    fn decoder_tuples_are_reversed_whole_and_upsample_types_not_at_all() {
        let c = parse(
            r#"{"_class_name": "AutoencoderKLLTX2Video", "decoder_block_out_channels": [512, 512, 512],
                "decoder_spatio_temporal_scaling": [true, true, true, false], "upsample_factor": [2, 1, 1, 1],
                "upsample_residual": [false, false, false], "upsample_type": ["spatial", "temporal", "spatiotemporal"]}"#,
            LtxClass::Ltx2,
        )
        .unwrap();
        assert!(c.up[0].up.is_none(), "{:?}", c.up[0]);
        assert_eq!(c.up[1].up.map(|(s, ..)| s), Some([2, 1, 1]), "block 1 takes upsample_type[1]");
        assert_eq!(c.up[2].up.map(|(s, ..)| s), Some([2, 2, 2]));
        // The encoder's mid block takes the last layers_per_block entry.
        let c = parse(
            r#"{"_class_name": "AutoencoderKLLTX2Video", "layers_per_block": [1, 1, 1, 1, 1, 3]}"#,
            LtxClass::Ltx2,
        )
        .unwrap();
        assert_eq!(c.encoder_mid_layers, 3);
        // A single bool is the LTX-2 class's shorthand only.
        let one = r#""spatio_temporal_scaling": true"#;
        let ltx2 = format!(r#"{{"_class_name": "AutoencoderKLLTX2Video", {one}}}"#);
        assert_eq!(parse(&ltx2, LtxClass::Ltx2).unwrap().down.len(), 4);
        let ltx = format!(r#"{{"_class_name": "AutoencoderKLLTXVideo", {one}}}"#);
        assert!(parse(&ltx, LtxClass::LtxVideo).unwrap_err().contains("list of bools"));
    }

    #[test]
    fn the_ratios_come_from_the_config_when_it_has_them() {
        let c = parse(
            r#"{"_class_name": "AutoencoderKLLTX2Video", "spatial_compression_ratio": 32,
                "temporal_compression_ratio": 8, "decoder_causal": false}"#,
            LtxClass::Ltx2,
        )
        .unwrap();
        assert_eq!((c.spatial_compression_ratio, c.temporal_compression_ratio), (32, 8));
        assert!(!c.decoder_causal);
    }

    #[test]
    fn ltx_video_095_layout_and_the_refused_older_ones() {
        let json = r#"{"_class_name": "AutoencoderKLLTXVideo",
            "block_out_channels": [128, 256, 512, 1024, 2048],
            "down_block_types": ["LTXVideo095DownBlock3D", "LTXVideo095DownBlock3D", "LTXVideo095DownBlock3D", "LTXVideo095DownBlock3D"],
            "downsample_type": ["spatial", "temporal", "spatiotemporal", "spatiotemporal"],
            "layers_per_block": [4, 6, 6, 2, 2], "spatio_temporal_scaling": [true, true, true, true],
            "decoder_block_out_channels": [256, 512, 1024], "decoder_layers_per_block": [5, 5, 5, 5],
            "decoder_spatio_temporal_scaling": [true, true, true], "decoder_inject_noise": [false, false, false, false],
            "upsample_residual": [true, true, true], "upsample_factor": [2, 2, 2], "timestep_conditioning": true}"#;
        let c = parse(json, LtxClass::LtxVideo).unwrap();
        assert_eq!(c.encoder_stem, 128);
        assert_eq!(c.down.len(), 4);
        assert_eq!((c.encoder_spatial_factor(), c.encoder_temporal_factor()), (32, 8));
        assert_eq!((c.decoder_spatial_factor(), c.decoder_temporal_factor()), (32, 8));
        assert!(c.timestep_conditioning && !c.decoder_causal);
        let old = parse(r#"{"_class_name": "AutoencoderKLLTXVideo"}"#, LtxClass::LtxVideo).unwrap_err();
        assert!(old.contains("0.9.5"), "{old}");
        let noisy = json.replace(
            r#""decoder_inject_noise": [false, false, false, false]"#,
            r#""decoder_inject_noise": [true, false, false, false]"#,
        );
        assert!(parse(&noisy, LtxClass::LtxVideo).unwrap_err().contains("noise"));
        let wrong = parse(r#"{"_class_name": "AutoencoderKLWan"}"#, LtxClass::LtxVideo).unwrap_err();
        assert!(wrong.contains("is not AutoencoderKLLTXVideo"), "{wrong}");
    }
}
