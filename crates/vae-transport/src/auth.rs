//! Group authentication: a 32-byte secret that every rank of a socket group holds, and the
//! mutual challenge–response each link runs with it before any other frame is accepted.
//!
//! The connecting side sends a fresh nonce; the accepting side answers with its own nonce and
//! an HMAC-SHA256, under the secret, of both nonces, the protocol version, the world size and
//! its rank; the connecting side checks it and sends its hello with an HMAC of both nonces and
//! the hello itself. Each side so proves it holds the secret without revealing it, a recorded
//! exchange cannot be replayed (the other side's nonce is new), and the rank, world size and
//! address a hello claims are bound to the proof. What it does not give: encryption, or
//! integrity of the frames after the handshake against someone who can rewrite TCP traffic —
//! run groups on a private network or through a tunnel for that.

use std::fmt;
use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::{Result, TransportError};

/// The group secret, as 64 hex digits.
pub const ENV_GROUP_SECRET: &str = "VAE_GROUP_SECRET";
/// A file holding the group secret (64 hex digits), instead of [`ENV_GROUP_SECRET`].
pub const ENV_GROUP_SECRET_FILE: &str = "VAE_GROUP_SECRET_FILE";
/// Set to `1` to let a TCP group run without a secret (any process that can reach the ports
/// may then join it).
pub const ENV_INSECURE_NO_AUTH: &str = "VAE_INSECURE_NO_AUTH";

/// Bytes of a secret, a nonce and a tag.
pub(crate) const LEN: usize = 32;

/// The secret every rank of one group holds. Never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct GroupSecret([u8; LEN]);

impl fmt::Debug for GroupSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GroupSecret(..)")
    }
}

fn invalid(message: impl Into<String>) -> TransportError {
    TransportError::InvalidArgument(message.into())
}

impl GroupSecret {
    /// A new secret from the operating system's random source.
    pub fn generate() -> Result<Self> {
        let mut bytes = [0u8; LEN];
        getrandom::fill(&mut bytes).map_err(|e| invalid(format!("no random source for a group secret: {e}")))?;
        Ok(Self(bytes))
    }

    /// A secret written as 64 hex digits (surrounding whitespace ignored).
    pub fn from_hex(text: &str) -> Result<Self> {
        let mut bytes = [0u8; LEN];
        hex::decode_to_slice(text.trim(), &mut bytes)
            .map_err(|_| invalid(format!("a group secret is {} hex digits", 2 * LEN)))?;
        Ok(Self(bytes))
    }

    /// The secret as 64 hex digits, to hand to the ranks a supervisor starts.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The secret of [`ENV_GROUP_SECRET`] or of the file [`ENV_GROUP_SECRET_FILE`] names, if
    /// either is set (both is an error).
    pub fn from_env() -> Result<Option<Self>> {
        let inline = std::env::var(ENV_GROUP_SECRET).ok();
        let file = std::env::var_os(ENV_GROUP_SECRET_FILE);
        match (inline, file) {
            (Some(_), Some(_)) => Err(invalid(format!("set {ENV_GROUP_SECRET} or {ENV_GROUP_SECRET_FILE}, not both"))),
            (Some(text), None) => Self::from_hex(&text).map(Some),
            (None, Some(path)) => {
                let path = Path::new(&path);
                let text = std::fs::read_to_string(path)
                    .map_err(|e| invalid(format!("{ENV_GROUP_SECRET_FILE}={}: {e}", path.display())))?;
                Self::from_hex(&text).map(Some)
            }
            (None, None) => Ok(None),
        }
    }

    /// The HMAC-SHA256 state after `parts`, each length-prefixed (so no two splits of the same
    /// bytes agree).
    fn mac(&self, parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        for part in parts {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac
    }

    /// The tag of `parts`.
    pub(crate) fn tag(&self, parts: &[&[u8]]) -> [u8; LEN] {
        self.mac(parts).finalize().into_bytes().into()
    }

    /// Whether `tag` is the tag of `parts` (in constant time).
    pub(crate) fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        self.mac(parts).verify_slice(tag).is_ok()
    }
}

/// A fresh nonce.
pub(crate) fn nonce() -> Result<[u8; LEN]> {
    let mut bytes = [0u8; LEN];
    getrandom::fill(&mut bytes).map_err(|e| invalid(format!("no random source for a nonce: {e}")))?;
    Ok(bytes)
}

/// What the accepting side's tag covers: who it is, in which group, answering which challenge.
pub(crate) fn acceptor_parts<'a>(context: &'a [u8; 24], challenge: &'a [u8], answer_nonce: &'a [u8]) -> [&'a [u8]; 4] {
    [b"vae-parallel acceptor", context, challenge, answer_nonce]
}

/// What the connecting side's tag covers: the acceptor's nonce, its own, and its hello.
pub(crate) fn connector_parts<'a>(
    context: &'a [u8; 24],
    acceptor_nonce: &'a [u8],
    own_nonce: &'a [u8],
    hello: &'a [u8],
) -> [&'a [u8]; 5] {
    [b"vae-parallel connector", context, acceptor_nonce, own_nonce, hello]
}

/// Protocol version, world size and the accepting rank, as the tags bind them.
pub(crate) fn context(version: u32, world: usize, acceptor_rank: usize) -> [u8; 24] {
    let mut c = [0u8; 24];
    c[0..8].copy_from_slice(&u64::from(version).to_le_bytes());
    c[8..16].copy_from_slice(&(world as u64).to_le_bytes());
    c[16..24].copy_from_slice(&(acceptor_rank as u64).to_le_bytes());
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_round_trip_through_hex_and_never_print() {
        let s = GroupSecret::generate().unwrap();
        assert_eq!(GroupSecret::from_hex(&format!(" {}\n", s.to_hex())).unwrap(), s);
        assert_ne!(GroupSecret::generate().unwrap(), s);
        assert_eq!(format!("{s:?}"), "GroupSecret(..)");
        for bad in ["", "abc", &"zz".repeat(32), &"ab".repeat(33)] {
            assert!(GroupSecret::from_hex(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn tags_bind_every_part_and_the_secret() {
        let (s, other) = (GroupSecret::generate().unwrap(), GroupSecret::generate().unwrap());
        let c = context(1, 4, 0);
        let parts = acceptor_parts(&c, b"challenge", b"answer");
        let tag = s.tag(&parts);
        assert!(s.verify(&parts, &tag));
        assert!(!other.verify(&parts, &tag), "another secret");
        assert!(!s.verify(&acceptor_parts(&context(1, 4, 1), b"challenge", b"answer"), &tag), "another rank");
        assert!(!s.verify(&acceptor_parts(&c, b"challengeX", b"answer"), &tag), "another nonce");
        // Length prefixes: moving bytes between parts changes the tag.
        assert!(!s.verify(&acceptor_parts(&c, b"challeng", b"eanswer"), &tag));
        assert!(!s.verify(&parts, &tag[..31]));
    }
}
