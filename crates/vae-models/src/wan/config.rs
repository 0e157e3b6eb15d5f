//! `config.json` of diffusers' `AutoencoderKLWan` and `AutoencoderKLQwenImage`.

use serde::Deserialize;

/// `config.json` of an `AutoencoderKLWan` (the fields the decoder needs; missing ones take
/// diffusers' defaults).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct WanConfig {
    /// `_class_name`: `AutoencoderKLWan` or `AutoencoderKLQwenImage` (none: Wan).
    #[serde(rename = "_class_name")]
    pub class_name: Option<String>,
    /// Encoder base width.
    pub base_dim: usize,
    /// Decoder base width (defaults to `base_dim`).
    pub decoder_base_dim: Option<usize>,
    /// Latent channels.
    pub z_dim: usize,
    /// Width multipliers per level.
    pub dim_mult: Vec<usize>,
    /// Residual blocks per level.
    pub num_res_blocks: usize,
    /// Attention scales (diffusers' Wan VAEs use none).
    pub attn_scales: Vec<f64>,
    /// Which encoder levels halve time (the decoder reverses it).
    pub temperal_downsample: Vec<bool>,
    /// Wan2.2's residual up/down blocks.
    pub is_residual: bool,
    /// Image channels in (`in_channels`; Qwen-Image's config calls it `input_channels`).
    #[serde(alias = "input_channels")]
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Wan2.2's patchify size.
    pub patch_size: Option<usize>,
    /// Pixels per latent pixel (8 for Wan2.1 and Qwen-Image, 16 for Wan2.2).
    pub scale_factor_spatial: Option<usize>,
    /// Per-channel latent mean (pipeline normalisation).
    pub latents_mean: Vec<f64>,
    /// Per-channel latent std (pipeline normalisation).
    pub latents_std: Vec<f64>,
}

impl Default for WanConfig {
    fn default() -> Self {
        Self {
            class_name: None,
            base_dim: 96,
            decoder_base_dim: None,
            z_dim: 16,
            dim_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            attn_scales: Vec::new(),
            temperal_downsample: vec![false, true, true],
            is_residual: false,
            in_channels: 3,
            out_channels: 3,
            patch_size: None,
            scale_factor_spatial: None,
            latents_mean: Vec::new(),
            latents_std: Vec::new(),
        }
    }
}
