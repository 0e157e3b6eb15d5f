//! `config.json` of diffusers' `AutoencoderKL` and `AutoencoderKLFlux2`.
//!
//! Every field is optional in the file; a missing field takes the default of the class named
//! by `_class_name`, exactly as `from_pretrained` would (the two classes have different
//! defaults). A field of the wrong type is an error naming the field.

use std::path::Path;

use serde::Deserialize;

use crate::{ModelError, Result};

/// Which diffusers class the checkpoint is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KlVariant {
    /// `AutoencoderKL` (SD 1.x/2.x/XL/3.x, FLUX.1, Z-Image).
    AutoencoderKl,
    /// `AutoencoderKLFlux2` (FLUX.2): adds `decoder_block_out_channels` and the latent batch-norm.
    Flux2,
}

impl KlVariant {
    /// The diffusers class name.
    pub const fn class_name(self) -> &'static str {
        match self {
            Self::AutoencoderKl => "AutoencoderKL",
            Self::Flux2 => "AutoencoderKLFlux2",
        }
    }
}

/// `sample_size`: an int, or `[height, width]` in some configs (diffusers tiles with the first).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum SampleSize {
    Square(usize),
    Pair(Vec<usize>),
}

/// The file as written, every field optional.
#[derive(Debug, Deserialize)]
struct RawConfig {
    #[serde(rename = "_class_name")]
    class_name: Option<String>,
    in_channels: Option<usize>,
    out_channels: Option<usize>,
    down_block_types: Option<Vec<String>>,
    up_block_types: Option<Vec<String>>,
    block_out_channels: Option<Vec<usize>>,
    decoder_block_out_channels: Option<Option<Vec<usize>>>,
    layers_per_block: Option<usize>,
    act_fn: Option<String>,
    latent_channels: Option<usize>,
    norm_num_groups: Option<usize>,
    sample_size: Option<SampleSize>,
    scaling_factor: Option<f64>,
    shift_factor: Option<Option<f64>>,
    latents_mean: Option<Option<Vec<f64>>>,
    latents_std: Option<Option<Vec<f64>>>,
    use_quant_conv: Option<bool>,
    use_post_quant_conv: Option<bool>,
    mid_block_add_attention: Option<bool>,
    batch_norm_eps: Option<f64>,
    patch_size: Option<Vec<usize>>,
}

/// A resolved AutoencoderKL-family configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoencoderKlConfig {
    /// The class.
    pub variant: KlVariant,
    /// Image channels in.
    pub in_channels: usize,
    /// Image channels out.
    pub out_channels: usize,
    /// Encoder widths, one per level.
    pub block_out_channels: Vec<usize>,
    /// Decoder widths (FLUX.2 may differ from the encoder's; otherwise equal).
    pub decoder_block_out_channels: Vec<usize>,
    /// ResNet blocks per encoder level (the decoder has one more).
    pub layers_per_block: usize,
    /// Latent channels.
    pub latent_channels: usize,
    /// GroupNorm groups.
    pub norm_num_groups: usize,
    /// `sample_size` (first entry when a pair): the default tile size in pixels.
    pub sample_size: usize,
    /// Latent scale the pipelines divide by (AutoencoderKL only; FLUX.2 uses its batch-norm).
    pub scaling_factor: Option<f64>,
    /// Latent shift the pipelines add after scaling, when set.
    pub shift_factor: Option<f64>,
    /// Per-channel latent statistics (SDXL-style pipelines use them with the scaling factor
    /// when both are set), as `(mean, std)`.
    pub latents_stats: Option<(Vec<f64>, Vec<f64>)>,
    /// Whether `quant_conv` exists.
    pub use_quant_conv: bool,
    /// Whether `post_quant_conv` exists.
    pub use_post_quant_conv: bool,
    /// Whether the mid blocks have attention.
    pub mid_block_add_attention: bool,
    /// FLUX.2 latent batch-norm epsilon.
    pub batch_norm_eps: f64,
    /// FLUX.2 latent patch size.
    pub patch_size: [usize; 2],
}

impl AutoencoderKlConfig {
    /// Reads and resolves `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ModelError::Io { path: path.to_path_buf(), source })?;
        Self::from_json(&text).map_err(|message| ModelError::Config { path: path.to_path_buf(), message })
    }

    /// Resolves a config from JSON text; the error is a message naming the offending field.
    pub fn from_json(text: &str) -> std::result::Result<Self, String> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let raw: RawConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            let field = e.path().to_string();
            format!("field `{field}`: {}", e.inner())
        })?;
        let variant = match raw.class_name.as_deref() {
            Some("AutoencoderKL") | None => KlVariant::AutoencoderKl,
            Some("AutoencoderKLFlux2") => KlVariant::Flux2,
            Some(other) => {
                return Err(format!(
                    "_class_name {other:?} is not an AutoencoderKL-family VAE (expected AutoencoderKL or AutoencoderKLFlux2)"
                ));
            }
        };
        let flux2 = variant == KlVariant::Flux2;
        // diffusers' constructor defaults, per class.
        let levels_default = if flux2 { vec![128, 256, 512, 512] } else { vec![64] };
        let block_out_channels = raw.block_out_channels.unwrap_or(levels_default);
        let n = block_out_channels.len();
        let types_default = |name: &str| vec![name.to_string(); if flux2 { 4 } else { 1 }];
        let down = raw.down_block_types.unwrap_or_else(|| types_default("DownEncoderBlock2D"));
        let up = raw.up_block_types.unwrap_or_else(|| types_default("UpDecoderBlock2D"));
        if let Some(bad) = down.iter().find(|t| *t != "DownEncoderBlock2D") {
            return Err(format!("down block type {bad:?} is not supported (only DownEncoderBlock2D)"));
        }
        if let Some(bad) = up.iter().find(|t| *t != "UpDecoderBlock2D") {
            return Err(format!("up block type {bad:?} is not supported (only UpDecoderBlock2D)"));
        }
        if down.len() != n || up.len() != n {
            return Err(format!("{} down and {} up block types for {n} block_out_channels", down.len(), up.len()));
        }
        let act = raw.act_fn.unwrap_or_else(|| "silu".into());
        if act != "silu" {
            return Err(format!("act_fn {act:?} is not supported (only silu)"));
        }
        let decoder_block_out_channels = match raw.decoder_block_out_channels.flatten() {
            Some(d) if !flux2 => {
                return Err(format!("decoder_block_out_channels {d:?} is only valid for AutoencoderKLFlux2"));
            }
            Some(d) => d,
            None => block_out_channels.clone(),
        };
        if decoder_block_out_channels.len() != n {
            return Err(format!(
                "decoder_block_out_channels has {} entries, expected {n}",
                decoder_block_out_channels.len()
            ));
        }
        let sample_size = match raw.sample_size {
            Some(SampleSize::Square(s)) => s,
            Some(SampleSize::Pair(p)) => *p.first().ok_or("field `sample_size`: empty list")?,
            None if flux2 => 1024,
            None => 32,
        };
        let norm_num_groups = raw.norm_num_groups.unwrap_or(32);
        let latent_channels = raw.latent_channels.unwrap_or(if flux2 { 32 } else { 4 });
        let patch_size = match raw.patch_size.as_deref() {
            None => [2, 2],
            Some([a, b]) => [*a, *b],
            Some(other) => return Err(format!("field `patch_size`: expected two entries, got {other:?}")),
        };
        let config = Self {
            variant,
            in_channels: raw.in_channels.unwrap_or(3),
            out_channels: raw.out_channels.unwrap_or(3),
            block_out_channels,
            decoder_block_out_channels,
            layers_per_block: raw.layers_per_block.unwrap_or(if flux2 { 2 } else { 1 }),
            latent_channels,
            norm_num_groups,
            sample_size,
            scaling_factor: if flux2 { None } else { Some(raw.scaling_factor.unwrap_or(0.18215)) },
            shift_factor: if flux2 { None } else { raw.shift_factor.flatten() },
            latents_stats: match (raw.latents_mean.flatten(), raw.latents_std.flatten()) {
                (Some(m), Some(s)) if !flux2 => Some((m, s)),
                _ => None,
            },
            use_quant_conv: raw.use_quant_conv.unwrap_or(true),
            use_post_quant_conv: raw.use_post_quant_conv.unwrap_or(true),
            mid_block_add_attention: raw.mid_block_add_attention.unwrap_or(true),
            batch_norm_eps: raw.batch_norm_eps.unwrap_or(1e-4),
            patch_size,
        };
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.block_out_channels.is_empty() {
            return Err("block_out_channels is empty".into());
        }
        // 2^(levels-1) is the spatial scale; real VAEs have 3 to 5 levels.
        if self.block_out_channels.len() > 16 {
            return Err(format!(
                "{} levels in block_out_channels; at most 16 are supported",
                self.block_out_channels.len()
            ));
        }
        if let Some((mean, std)) = &self.latents_stats
            && (mean.len() != self.latent_channels || std.len() != self.latent_channels)
        {
            return Err(format!(
                "latents_mean / latents_std have {} / {} entries for {} latent channels",
                mean.len(),
                std.len(),
                self.latent_channels
            ));
        }
        if self.norm_num_groups == 0 {
            return Err("norm_num_groups is 0".into());
        }
        for &c in self.block_out_channels.iter().chain(&self.decoder_block_out_channels) {
            if c == 0 || c % self.norm_num_groups != 0 {
                return Err(format!(
                    "block width {c} is not a positive multiple of norm_num_groups {}",
                    self.norm_num_groups
                ));
            }
        }
        if self.latent_channels == 0 || self.in_channels == 0 || self.out_channels == 0 {
            return Err("channel counts must be positive".into());
        }
        if self.variant == KlVariant::Flux2 && self.patch_size != [2, 2] {
            return Err(format!(
                "patch_size {:?} is not supported (the FLUX.2 pipeline patchifies 2x2)",
                self.patch_size
            ));
        }
        Ok(())
    }

    /// Number of levels (`len(block_out_channels)`).
    pub fn levels(&self) -> usize {
        self.block_out_channels.len()
    }

    /// Pixels per latent pixel: `2^(levels - 1)`.
    pub fn spatial_scale(&self) -> usize {
        1 << (self.levels() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_fields_take_the_class_defaults() {
        let akl = AutoencoderKlConfig::from_json(r#"{"_class_name": "AutoencoderKL"}"#).unwrap();
        assert_eq!((akl.block_out_channels.clone(), akl.latent_channels, akl.sample_size), (vec![64], 4, 32));
        assert_eq!(akl.scaling_factor, Some(0.18215));
        let flux2 = AutoencoderKlConfig::from_json(r#"{"_class_name": "AutoencoderKLFlux2"}"#).unwrap();
        assert_eq!(flux2.block_out_channels, vec![128, 256, 512, 512]);
        assert_eq!((flux2.latent_channels, flux2.sample_size, flux2.layers_per_block), (32, 1024, 2));
        assert_eq!(flux2.decoder_block_out_channels, flux2.block_out_channels);
    }

    #[test]
    fn bad_fields_are_named() {
        let err = AutoencoderKlConfig::from_json(r#"{"latent_channels": "four"}"#).unwrap_err();
        assert!(err.contains("latent_channels"), "{err}");
        let err = AutoencoderKlConfig::from_json(r#"{"_class_name": "UNet2DModel"}"#).unwrap_err();
        assert!(err.contains("UNet2DModel"), "{err}");
        let err = AutoencoderKlConfig::from_json(r#"{"block_out_channels": [30], "norm_num_groups": 32}"#).unwrap_err();
        assert!(err.contains("norm_num_groups"), "{err}");
    }

    #[test]
    fn sample_size_may_be_a_pair() {
        let c = AutoencoderKlConfig::from_json(r#"{"sample_size": [512, 768]}"#).unwrap();
        assert_eq!(c.sample_size, 512);
    }
}
