//! The owner's verdicts on the wire: what rank 0 decided after a gather (the ranks agree, the
//! tiles merged, or which agreed error every rank returns), encoded for the one broadcast that
//! tells the others.
//!
//! Deciding on one rank and broadcasting the decision keeps a request's coordination linear in
//! the group's size (N − 1 messages in, N − 1 out); an all_gather where every rank decides for
//! itself costs N² messages, which at thousands of ranks outweighs the decode itself.

use vae_transport::wire::{Reader, Writer};

use crate::{FailureKind, RuntimeError, Stage};

const OK: u8 = 0;
const INPUT_MISMATCH: u8 = 1;
const OPERATOR: u8 = 2;
const CONFIG: u8 = 3;
const INCONSISTENT: u8 = 4;

/// Writes a verdict: `Ok` followed by `payload`, or an error. Only agreed errors travel (see
/// [`RuntimeError::is_agreed`]); anything else the owner hit is told as a merge failure on
/// the owner with its text, which is what it is to the other ranks.
pub(super) fn write(w: &mut Writer, verdict: Result<&[u8], &RuntimeError>, owner: usize) {
    let err = match verdict {
        Ok(payload) => {
            w.u8(OK).bytes(payload);
            return;
        }
        Err(err) => err,
    };
    match err {
        RuntimeError::InputMismatch { hashes } => {
            w.u8(INPUT_MISMATCH).usize(hashes.len());
            for h in hashes {
                w.u64(*h);
            }
        }
        RuntimeError::Operator { stage, rank, kind, message } => {
            w.u8(OPERATOR);
            write_stage(w, *stage);
            write_kind(w, *kind).usize(*rank).str(message);
        }
        RuntimeError::Config(message) => {
            w.u8(CONFIG).str(message);
        }
        RuntimeError::Inconsistent(message) => {
            w.u8(INCONSISTENT).str(message);
        }
        other => {
            w.u8(OPERATOR);
            write_stage(w, Stage::Merge);
            write_kind(w, FailureKind::Failed).usize(owner).str(&other.to_string());
        }
    }
}

/// Reads what [`write`] wrote: the payload after `Ok`, or the agreed error.
pub(super) fn read(bytes: &[u8]) -> Result<Result<&[u8], RuntimeError>, RuntimeError> {
    let mut rd = Reader::new(bytes, "verdict");
    let err = match rd.u8()? {
        OK => return Ok(Ok(rd.rest())),
        INPUT_MISMATCH => {
            let count = rd.usize()?;
            // Each hash is 8 bytes: a count its bytes cannot back is refused before allocating.
            if count > bytes.len() / 8 {
                return Err(RuntimeError::Protocol(format!("verdict claims {count} input hashes")));
            }
            let hashes = (0..count).map(|_| rd.u64()).collect::<Result<Vec<_>, _>>()?;
            RuntimeError::InputMismatch { hashes }
        }
        OPERATOR => {
            let stage = read_stage(&mut rd)?;
            let kind = read_kind(&mut rd)?;
            RuntimeError::Operator { stage, rank: rd.usize()?, kind, message: rd.str()? }
        }
        CONFIG => RuntimeError::Config(rd.str()?),
        INCONSISTENT => RuntimeError::Inconsistent(rd.str()?),
        tag => return Err(RuntimeError::Protocol(format!("unknown verdict {tag}"))),
    };
    Ok(Err(err))
}

fn write_stage(w: &mut Writer, stage: Stage) {
    match stage {
        Stage::Split => w.u8(0),
        Stage::Exec { tile_id } => w.u8(1).usize(tile_id),
        Stage::Merge => w.u8(2),
        Stage::Shard => w.u8(3),
        Stage::Pipeline { stage } => w.u8(4).usize(stage),
    };
}

fn read_stage(rd: &mut Reader<'_>) -> Result<Stage, RuntimeError> {
    Ok(match rd.u8()? {
        0 => Stage::Split,
        1 => Stage::Exec { tile_id: rd.usize()? },
        2 => Stage::Merge,
        3 => Stage::Shard,
        4 => Stage::Pipeline { stage: rd.usize()? },
        tag => return Err(RuntimeError::Protocol(format!("unknown stage {tag}"))),
    })
}

/// Writes an operator failure's kind (one byte); also used by the agreement and the tile
/// summaries, which carry a rank's failure to the owner.
pub(super) fn write_kind(w: &mut Writer, kind: FailureKind) -> &mut Writer {
    w.u8(kind.code())
}

/// Reads what [`write_kind`] wrote; an unknown byte is a protocol error.
pub(super) fn read_kind(rd: &mut Reader<'_>) -> Result<FailureKind, RuntimeError> {
    let code = rd.u8()?;
    FailureKind::from_code(code).ok_or_else(|| RuntimeError::Protocol(format!("unknown failure kind {code}")))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn round_trip(err: &RuntimeError) -> RuntimeError {
        let mut w = Writer::new();
        write(&mut w, Err(err), 0);
        read(w.as_slice()).unwrap().unwrap_err()
    }

    #[test]
    fn every_agreed_error_arrives_as_it_left() {
        let errors = [
            RuntimeError::InputMismatch { hashes: vec![1, u64::MAX, 3] },
            RuntimeError::Operator {
                stage: Stage::Split,
                rank: 3,
                kind: FailureKind::InvalidInput,
                message: "no".into(),
            },
            RuntimeError::Operator {
                stage: Stage::Exec { tile_id: 17 },
                rank: 4095,
                kind: FailureKind::Failed,
                message: "tile".into(),
            },
            RuntimeError::Operator {
                stage: Stage::Merge,
                rank: 0,
                kind: FailureKind::Unsupported,
                message: String::new(),
            },
            RuntimeError::Operator { stage: Stage::Shard, rank: 2, kind: FailureKind::Failed, message: "band".into() },
            RuntimeError::Operator {
                stage: Stage::Pipeline { stage: 3 },
                rank: 3,
                kind: FailureKind::Failed,
                message: "stage".into(),
            },
            RuntimeError::Config("bad".into()),
            RuntimeError::Inconsistent("tile 3 came back twice (rank 1)".into()),
        ];
        for err in &errors {
            assert!(err.is_agreed());
            let got = round_trip(err);
            assert_eq!(got.to_string(), err.to_string());
            assert_eq!(got.failure_kind(), err.failure_kind());
        }
    }

    #[test]
    fn other_errors_become_the_owners_merge_failure() {
        let err = RuntimeError::Protocol("garbled".into());
        let got = round_trip(&err);
        assert!(
            matches!(&got, RuntimeError::Operator { stage: Stage::Merge, rank: 0, kind: FailureKind::Failed, message } if message.contains("garbled"))
        );
    }

    #[test]
    fn an_unknown_failure_kind_is_a_protocol_error() {
        let err = RuntimeError::Operator {
            stage: Stage::Split,
            rank: 1,
            kind: FailureKind::InvalidInput,
            message: "x".into(),
        };
        let mut w = Writer::new();
        write(&mut w, Err(&err), 0);
        let mut bytes = w.into_bytes();
        // The verdict's tag, the stage, then the kind.
        assert_eq!(bytes[2], FailureKind::InvalidInput.code());
        bytes[2] = 200;
        assert!(matches!(read(&bytes), Err(RuntimeError::Protocol(m)) if m.contains("unknown failure kind 200")));
    }

    #[test]
    fn the_payload_follows_ok() {
        let mut w = Writer::new();
        write(&mut w, Ok(&[9, 8, 7]), 0);
        assert_eq!(read(w.as_slice()).unwrap().unwrap(), &[9, 8, 7]);
    }

    proptest! {
        /// A verdict is decoded or refused, never trusted into a panic or an allocation its bytes
        /// do not back.
        #[test]
        fn fuzz_verdicts(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = read(&bytes);
            for tag in [INPUT_MISMATCH, OPERATOR] {
                let mut tagged = vec![tag];
                tagged.extend_from_slice(&bytes);
                let _ = read(&tagged);
            }
        }
    }
}
