//! What a client asks for: the request's options (JSON in the `X-VAE-Options` header), their
//! resolution into the library's [`Decode`] / [`Encode`] over the service's own settings (the
//! same [`Settings::resolve`] the CLI's flags go through, so a request gets the CLI's bytes),
//! the input body's parsing, and the frame rank 0 broadcasts so that every rank of a group of
//! processes runs the same request.

use serde::{Deserialize, Serialize};

use crate::settings::Settings;
use crate::{Decode, Encode, EncodeOutput, Error, Tensor, io};

/// Decode or encode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Latent to pixels.
    Decode,
    /// Pixels to latent.
    Encode,
}

impl Kind {
    /// `decode` or `encode` (a metrics label).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Decode => "decode",
            Self::Encode => "encode",
        }
    }
}

/// How a decode's pixels come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Response {
    /// The float32 `.npy` the CLI's `--out x.npy` writes.
    #[default]
    Npy,
    /// One image (a batch of one) after diffusers' post-processing, as the CLI's `.png`.
    Png,
    /// One video (a batch of one) as the CLI's `.gif`.
    Gif,
    /// One video (a batch of one) as the CLI's `.mp4` (ffmpeg on the server's PATH).
    Mp4,
    /// A video's frames as they are decoded: consecutive `.npy` arrays `[B, C, n, H, W]`,
    /// together the whole decode's frames bit for bit.
    Frames,
}

/// The options of one request, as the client sends them. The settings a request may set are the
/// per-request ones; what the service loaded (ranks, transport, device, dtype, tile geometry)
/// is fixed when it starts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestOptions {
    /// The model's configured name (`--model NAME=DIR`).
    pub model: String,
    /// How a decode's pixels come back (default `npy`).
    #[serde(default)]
    pub response: Response,
    /// An encode's result: `mean` (default) or `moments`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
    /// Frames per second of a `gif` or `mp4` answer (default the CLI's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fps: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// How the ranks split the work (`--vae-parallel-mode`), e.g. `spatial_shard_height`.
    pub vae_parallel_mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// How many ranks share the request (`--vae-patch-parallel-size`).
    pub vae_patch_parallel_size: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// The grid of shards, `RxC` (`--shard-grid`).
    pub shard_grid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// How tiles' overlaps are merged (`--tile-merge`).
    pub tile_merge: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Whether the input is cut into tiles (`--vae-use-tiling`).
    pub vae_use_tiling: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Whether the latent is already normalized (`--latents-normalized`).
    pub latents_normalized: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// The memory each rank may use, bytes or with K, M or G (`--max-memory-per-rank`).
    pub max_memory_per_rank: Option<String>,
}

/// A request's options refused before it is queued: a 400 with this line.
pub fn parse_options(text: &str) -> Result<RequestOptions, String> {
    if text.trim().is_empty() {
        return Err("the X-VAE-Options header must hold the request's options as JSON, e.g. {\"model\":\"sd\"}".into());
    }
    serde_json::from_str(text).map_err(|e| format!("X-VAE-Options is not valid options JSON: {e}"))
}

impl RequestOptions {
    /// The library's decode options: the service's settings with this request's over them,
    /// resolved as the CLI resolves its flags.
    pub fn decode(&self, base: &Settings) -> Result<Decode, Error> {
        Ok(Decode::default().with_options(self.settings().or(base.clone()).resolve()?.options))
    }

    /// The library's encode options (as [`Self::decode`]), with the result asked for.
    pub fn encode(&self, base: &Settings) -> Result<Encode, Error> {
        let output: EncodeOutput = self.output.as_deref().unwrap_or("mean").parse()?;
        Ok(Encode::default().with_options(self.settings().or(base.clone()).resolve()?.options).output(output))
    }

    /// The settings this request gives.
    fn settings(&self) -> Settings {
        Settings {
            vae_parallel_mode: self.vae_parallel_mode.clone(),
            vae_patch_parallel_size: self.vae_patch_parallel_size,
            shard_grid: self.shard_grid.clone(),
            tile_merge: self.tile_merge.clone(),
            vae_use_tiling: self.vae_use_tiling,
            latents_normalized: self.latents_normalized,
            max_memory_per_rank: self.max_memory_per_rank.clone(),
            ..Settings::default()
        }
    }
}

/// The request body as a tensor: a `.npy`, a `.safetensors` holding one tensor, or (to encode)
/// an 8-bit PNG, told apart by their first bytes, read as the CLI reads those files.
pub fn read_body(bytes: &[u8], kind: Kind) -> Result<Tensor, Error> {
    let tensor = if bytes.starts_with(b"\x93NUMPY") {
        io::npy_from_bytes(bytes)?
    } else if bytes.starts_with(b"\x89PNG") {
        if kind == Kind::Decode {
            return Err(Error::Io(io::IoError::Malformed(
                "a decode takes a latent (.npy or .safetensors), not a PNG".into(),
            )));
        }
        io::png_from_bytes(bytes)?
    } else if bytes.is_empty() {
        return Err(Error::Io(io::IoError::Malformed(
            "the request body is empty: send a .npy or .safetensors tensor".into(),
        )));
    } else {
        io::safetensors_from_bytes(bytes)?
    };
    Ok(tensor)
}

/// What rank 0 broadcasts to the other ranks of a group of processes before each request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Frame {
    /// Nothing to run: keeps the idle group's collectives within their timeout, and finds a rank
    /// that died while the group was idle.
    Heartbeat,
    /// Run this request (the input follows the frame's JSON, as a `.npy`).
    Run {
        /// Decode or encode.
        kind: Kind,
        /// The request's options.
        options: RequestOptions,
        /// A streamed decode (`decode_to`).
        streamed: bool,
    },
    /// The service is stopping: leave the group and exit.
    Stop,
}

impl Frame {
    /// The frame's bytes: a little-endian `u32` length, the JSON, then the input's `.npy`.
    pub fn to_bytes(&self, input: Option<&Tensor>) -> Result<Vec<u8>, Error> {
        let json = serde_json::to_vec(self).map_err(|e| Error::invalid_option(e.to_string()))?;
        let mut out = Vec::with_capacity(4 + json.len());
        out.extend_from_slice(&(json.len() as u32).to_le_bytes());
        out.extend_from_slice(&json);
        if let Some(input) = input {
            out.extend_from_slice(&io::npy_bytes(input)?);
        }
        Ok(out)
    }

    /// A frame and its input from [`Self::to_bytes`]'s bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<(Frame, Option<Tensor>), Error> {
        let bad = |m: &str| Error::Io(io::IoError::Malformed(format!("a request frame from rank 0: {m}")));
        let len = bytes.get(..4).ok_or_else(|| bad("too short"))?;
        let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
        let json = bytes.get(4..4 + len).ok_or_else(|| bad("truncated"))?;
        let frame: Frame = serde_json::from_slice(json).map_err(|e| bad(&e.to_string()))?;
        let rest = &bytes[4 + len..];
        let input = if rest.is_empty() { None } else { Some(io::npy_from_bytes(rest)?) };
        Ok((frame, input))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse_and_refuse_unknown_fields() {
        let o = parse_options(r#"{"model":"sd","response":"png","vae_parallel_mode":"auto"}"#).unwrap();
        assert_eq!((o.model.as_str(), o.response), ("sd", Response::Png));
        assert!(parse_options(r#"{"model":"sd","ranks":4}"#).unwrap_err().contains("unknown field"));
        assert!(parse_options("{not json").is_err());
        assert!(parse_options("").is_err());
    }

    #[test]
    fn a_frame_round_trips_with_its_input() {
        let t = Tensor::from_vec(vec![1.0, -2.5, 3.0, 0.0], [1, 1, 2, 2], &crate::Device::Cpu).unwrap();
        let frame = Frame::Run {
            kind: Kind::Decode,
            options: RequestOptions { model: "m".into(), ..Default::default() },
            streamed: true,
        };
        let (back, input) = Frame::from_bytes(&frame.to_bytes(Some(&t)).unwrap()).unwrap();
        assert_eq!(back, frame);
        assert_eq!(input.unwrap().to_vec_f32().unwrap(), t.to_vec_f32().unwrap());
        assert_eq!(Frame::from_bytes(&Frame::Heartbeat.to_bytes(None).unwrap()).unwrap().0, Frame::Heartbeat);
    }

    #[test]
    fn request_settings_resolve_as_the_cli_resolves_flags() {
        let base = Settings { ranks: Some(2), vae_patch_parallel_size: Some(2), ..Settings::default() };
        let o = RequestOptions { model: "m".into(), shard_grid: Some("2x1".into()), ..Default::default() };
        let err = o.decode(&base).unwrap_err();
        assert!(err.to_line().contains("`shard_grid`"), "{err}");
        let o = RequestOptions { model: "m".into(), output: Some("sideways".into()), ..Default::default() };
        assert!(o.encode(&base).is_err());
    }
}
