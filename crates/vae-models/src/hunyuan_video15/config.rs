//! `config.json` of diffusers' `AutoencoderKLHunyuanVideo15`, and the level layout both halves
//! derive from it.

use serde::Deserialize;

/// `config.json` of an `AutoencoderKLHunyuanVideo15` (missing fields take diffusers' defaults).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct HunyuanVideo15Config {
    /// `_class_name`.
    #[serde(rename = "_class_name")]
    pub class_name: Option<String>,
    /// Video channels in.
    pub in_channels: usize,
    /// Video channels out.
    pub out_channels: usize,
    /// Latent channels (the encoder emits twice as many moments).
    pub latent_channels: usize,
    /// Encoder widths per level (the decoder takes them reversed).
    pub block_out_channels: Vec<usize>,
    /// Resnets per encoder level (the decoder has one more per level).
    pub layers_per_block: usize,
    /// Pixels per latent pixel along H and W (a power of two).
    pub spatial_compression_ratio: usize,
    /// Frames per latent frame after the first (a power of two).
    pub temporal_compression_ratio: usize,
    /// Whether a downsample's output width is the next level's (`true`) or its own.
    pub downsample_match_channel: bool,
    /// Whether an upsample's output width is the next level's (`true`) or its own.
    pub upsample_match_channel: bool,
    /// The pipelines' latent scale: they decode `z / scaling_factor` and condition on
    /// `mode · scaling_factor`.
    pub scaling_factor: f64,
}

impl Default for HunyuanVideo15Config {
    fn default() -> Self {
        Self {
            class_name: None,
            in_channels: 3,
            out_channels: 3,
            latent_channels: 32,
            block_out_channels: vec![128, 256, 512, 1024, 1024],
            layers_per_block: 2,
            spatial_compression_ratio: 16,
            temporal_compression_ratio: 4,
            downsample_match_channel: true,
            upsample_match_channel: true,
            scaling_factor: 1.03682,
        }
    }
}

/// What one level of the encoder (or decoder) does after its resnets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Resample {
    /// Halves (doubles) H and W.
    pub(super) spatial: bool,
    /// Also halves (doubles) the frames after the first.
    pub(super) temporal: bool,
    /// Channels after it.
    pub(super) out_channels: usize,
}

impl HunyuanVideo15Config {
    /// `log2` of a compression ratio, which must be a power of two.
    fn log2(ratio: usize, what: &str) -> Result<usize, String> {
        if ratio == 0 || !ratio.is_power_of_two() {
            return Err(format!("{what} must be a power of two, got {ratio}"));
        }
        Ok(ratio.trailing_zeros() as usize)
    }

    /// Checks what the diffusers class would fail on at its first forward (reshapes of channels
    /// into groups that do not divide), so a bad config is a load error.
    pub(super) fn validate(&self) -> Result<(), String> {
        let levels = self.block_out_channels.len();
        if levels == 0 || self.block_out_channels.contains(&0) {
            return Err(format!(
                "block_out_channels must be non-empty and positive, got {:?}",
                self.block_out_channels
            ));
        }
        if self.latent_channels == 0 || self.in_channels == 0 || self.out_channels == 0 {
            return Err("in_channels, out_channels and latent_channels must be positive".into());
        }
        let s = Self::log2(self.spatial_compression_ratio, "spatial_compression_ratio")?;
        let t = Self::log2(self.temporal_compression_ratio, "temporal_compression_ratio")?;
        if s >= levels || t > s {
            return Err(format!(
                "{} levels cannot hold {s} spatial and {t} temporal halvings (block_out_channels {:?})",
                levels, self.block_out_channels
            ));
        }
        let last = self.block_out_channels[levels - 1];
        if !last.is_multiple_of(2 * self.latent_channels) {
            return Err(format!(
                "the widest level ({last}) must be a multiple of twice latent_channels ({})",
                self.latent_channels
            ));
        }
        let fail = |what: &str, i: usize, from: usize, r: Resample| {
            Err(format!(
                "{what} level {i}: {} x {} cannot regroup {from} channels into {}",
                if r.temporal { "2 x 2 x 2" } else { "2 x 2" },
                if r.temporal { "time x space" } else { "space" },
                r.out_channels
            ))
        };
        for (i, r) in self.encoder_levels()?.into_iter().enumerate() {
            let Some(r) = r else { continue };
            let (width, out) = (self.block_out_channels[i], r.out_channels);
            let factor = if r.temporal { 8 } else { 4 };
            // The conv makes out / factor channels; the shortcut averages groups of
            // factor · width / out (the first frame's of half as many).
            let ok = out.is_multiple_of(factor)
                && (factor * width).is_multiple_of(out)
                && (!r.temporal || (4 * width).is_multiple_of(out));
            if !ok {
                return fail("encoder", i, width, r);
            }
        }
        let widths: Vec<usize> = self.block_out_channels.iter().rev().copied().collect();
        for (i, r) in self.decoder_levels()?.into_iter().enumerate() {
            let Some(r) = r else { continue };
            let (width, out) = (widths[i], r.out_channels);
            let factor = if r.temporal { 8 } else { 4 };
            // The shortcut repeats each channel factor · out / width times (the first frame's
            // half as often, after folding its 2 x 2 pixels into channels).
            let ok = (factor * out).is_multiple_of(width)
                && (!r.temporal || (width.is_multiple_of(8) && (factor * out / width).is_multiple_of(2)));
            if !ok {
                return fail("decoder", i, width, r);
            }
        }
        Ok(())
    }

    /// The encoder's levels: what follows each one's resnets (`None`: nothing). Level `i`
    /// downsamples while `i < log2(spatial ratio)`, in time too from `log2(spatial / temporal)`.
    pub(super) fn encoder_levels(&self) -> Result<Vec<Option<Resample>>, String> {
        let s = Self::log2(self.spatial_compression_ratio, "spatial_compression_ratio")?;
        let t = Self::log2(self.temporal_compression_ratio, "temporal_compression_ratio")?;
        let widths = &self.block_out_channels;
        Ok((0..widths.len())
            .map(|i| {
                (i < s).then(|| Resample {
                    spatial: true,
                    temporal: i >= s - t,
                    out_channels: if self.downsample_match_channel { widths[i + 1] } else { widths[i] },
                })
            })
            .collect())
    }

    /// The decoder's levels (over the reversed widths): level `i` upsamples while
    /// `i < log2(spatial ratio)` or `i < log2(temporal ratio)`, in time while the latter.
    pub(super) fn decoder_levels(&self) -> Result<Vec<Option<Resample>>, String> {
        let s = Self::log2(self.spatial_compression_ratio, "spatial_compression_ratio")?;
        let t = Self::log2(self.temporal_compression_ratio, "temporal_compression_ratio")?;
        let widths: Vec<usize> = self.block_out_channels.iter().rev().copied().collect();
        Ok((0..widths.len())
            .map(|i| {
                (i < s || i < t).then(|| Resample {
                    spatial: true,
                    temporal: i < t,
                    out_channels: if self.upsample_match_channel { widths[i + 1] } else { widths[i] },
                })
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_published_layout_downsamples_four_times_the_last_two_in_time() {
        let c = HunyuanVideo15Config::default();
        c.validate().unwrap();
        let enc = c.encoder_levels().unwrap();
        let temporal: Vec<bool> = enc.iter().map(|r| r.is_some_and(|r| r.temporal)).collect();
        assert_eq!(temporal, [false, false, true, true, false]);
        assert!(enc[4].is_none());
        let dec = c.decoder_levels().unwrap();
        let temporal: Vec<bool> = dec.iter().map(|r| r.is_some_and(|r| r.temporal)).collect();
        assert_eq!(temporal, [true, true, false, false, false]);
        assert_eq!(dec.iter().filter(|r| r.is_some()).count(), 4);
        assert_eq!(dec[0].unwrap().out_channels, 1024);
        assert_eq!(dec[3].unwrap().out_channels, 128);
    }

    #[test]
    fn configs_the_class_cannot_run_are_refused() {
        let bad = HunyuanVideo15Config { spatial_compression_ratio: 12, ..Default::default() };
        assert!(bad.validate().unwrap_err().contains("power of two"));
        let bad = HunyuanVideo15Config { latent_channels: 48, ..Default::default() };
        assert!(bad.validate().unwrap_err().contains("latent_channels"));
        let bad = HunyuanVideo15Config { block_out_channels: vec![128, 256, 512, 1000, 1024], ..Default::default() };
        assert!(bad.validate().unwrap_err().contains("level"), "{:?}", bad.validate());
        let bad = HunyuanVideo15Config { block_out_channels: vec![128, 256], ..Default::default() };
        assert!(bad.validate().unwrap_err().contains("levels"));
    }
}
