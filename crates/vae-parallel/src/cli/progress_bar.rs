//! Rank 0's progress on the terminal during a decode or encode: after a second, a bar of the
//! share done with the time left, from what the layers report (`vae_runtime::progress`: this
//! rank's tiles, and the temporal steps of the tile or band being computed), or a spinner with
//! the time so far while they have reported nothing (an image VAE's single tile). Hidden when
//! stderr is not a terminal.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

use crate::runtime::{Progress, ProgressSink};

/// Bar positions: the share done in thousandths.
const SCALE: u64 = 1000;

/// What the layers have reported so far.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Position {
    tiles: Option<(usize, usize)>,
    steps: Option<(usize, usize)>,
}

impl Position {
    fn apply(&mut self, update: Progress) {
        match update {
            Progress::Tiles { done, total } => {
                self.tiles = Some((done, total));
                // The next tile's steps start from zero.
                self.steps = None;
            }
            Progress::Steps { done, total } => self.steps = Some((done, total)),
        }
    }

    /// The share of this rank's work done, when anything has been reported: whole tiles plus
    /// the current tile's share of its steps.
    fn fraction(&self) -> Option<f64> {
        let within = self.steps.filter(|&(_, t)| t > 0).map_or(0.0, |(d, t)| d as f64 / t as f64);
        let share = match self.tiles {
            Some((_, 0)) => 1.0,
            Some((done, total)) => (done as f64 + within) / total as f64,
            None => {
                self.steps?;
                within
            }
        };
        Some(share.clamp(0.0, 1.0))
    }

    /// `tile 3/15 · frame 2/5`, naming whatever has been reported.
    fn label(&self, step_noun: &str) -> String {
        let tiles = self.tiles.filter(|&(_, t)| t > 1).map(|(d, t)| format!("tile {}/{t}", (d + 1).min(t)));
        let steps = self.steps.map(|(d, t)| format!("{step_noun} {d}/{t}"));
        tiles.into_iter().chain(steps).collect::<Vec<_>>().join(" · ")
    }
}

/// The display of one request on this process; dropped when it ends.
pub(crate) struct ProgressDisplay {
    done: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    sink: Option<ProgressSink>,
}

impl ProgressDisplay {
    /// Starts the display for `what` (`decoding`) counting `step_noun`s (`frame`) when `show`
    /// (rank 0); elsewhere it does nothing. The updates shown are those sent to
    /// [`Self::sink`] (the request's: `Request::progress`).
    pub(crate) fn start(what: &'static str, step_noun: &'static str, show: bool) -> Self {
        let done = Arc::new(AtomicBool::new(false));
        if !show {
            return Self { done, thread: None, sink: None };
        }
        let position = Arc::new(Mutex::new(Position::default()));
        let updates = Arc::clone(&position);
        let sink: ProgressSink = Arc::new(move |update| {
            if let Ok(mut p) = updates.lock() {
                p.apply(update);
            }
        });
        let flag = Arc::clone(&done);
        let thread = std::thread::spawn(move || {
            let started = Instant::now();
            let mut bar: Option<ProgressBar> = None;
            // Whether the bar shows a share yet (else it spins).
            let mut measured = false;
            while !flag.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(100));
                if started.elapsed() < Duration::from_secs(1) {
                    continue;
                }
                let now = position.lock().map(|p| *p).unwrap_or_default();
                // The time shown counts from the request's start, not from when the bar appears.
                let b = bar.get_or_insert_with(|| {
                    ProgressBar::new(SCALE).with_elapsed(started.elapsed()).with_style(
                        ProgressStyle::with_template("{spinner} {msg} {elapsed}")
                            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
                    )
                });
                match now.fraction() {
                    Some(share) => {
                        if !measured {
                            b.set_style(
                                ProgressStyle::with_template(
                                    "{msg} [{bar:30}] {percent:>3}% {elapsed} (about {eta} left)",
                                )
                                .unwrap_or_else(|_| ProgressStyle::default_bar())
                                .progress_chars("=> "),
                            );
                            measured = true;
                        }
                        b.set_position((share * SCALE as f64) as u64);
                    }
                    None if !measured => b.tick(),
                    None => {}
                }
                let label = now.label(step_noun);
                b.set_message(if label.is_empty() { what.to_string() } else { format!("{what} {label}") });
            }
            if let Some(b) = bar {
                b.finish_and_clear();
            }
        });
        Self { done, thread: Some(thread), sink: Some(sink) }
    }

    /// Where the owner's rank sends its updates (`None` where nothing is shown).
    pub(crate) fn sink(&self) -> Option<ProgressSink> {
        self.sink.clone()
    }
}

impl Drop for ProgressDisplay {
    fn drop(&mut self) {
        self.done.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn after(updates: &[Progress]) -> Position {
        let mut p = Position::default();
        updates.iter().for_each(|u| p.apply(*u));
        p
    }

    #[test]
    fn the_share_counts_whole_tiles_and_the_current_tiles_steps() {
        use Progress::{Steps, Tiles};
        assert_eq!(after(&[]).fraction(), None);
        assert_eq!(after(&[Tiles { done: 0, total: 4 }]).fraction(), Some(0.0));
        // One tile of four done, and half the frames of the next.
        let p = after(&[Tiles { done: 0, total: 4 }, Steps { done: 2, total: 2 }, Tiles { done: 1, total: 4 }]);
        assert_eq!(p.fraction(), Some(0.25), "a finished tile's steps do not count twice");
        let p = after(&[Tiles { done: 1, total: 4 }, Steps { done: 1, total: 2 }]);
        assert_eq!(p.fraction(), Some(0.375));
        assert_eq!(p.label("frame"), "tile 2/4 · frame 1/2");
        // A band (shard mode) reports steps alone; an idle rank has no tiles.
        let band = after(&[Steps { done: 3, total: 5 }]);
        assert_eq!(band.fraction(), Some(0.6));
        assert_eq!(band.label("frame"), "frame 3/5");
        assert_eq!(after(&[Tiles { done: 0, total: 0 }]).fraction(), Some(1.0));
        // One tile: the steps tell the share, and the label does not count tiles.
        let one = after(&[Tiles { done: 0, total: 1 }, Steps { done: 1, total: 4 }]);
        assert_eq!((one.fraction(), one.label("chunk").as_str()), (Some(0.25), "chunk 1/4"));
        let finished = after(&[Tiles { done: 0, total: 3 }, Tiles { done: 3, total: 3 }]);
        assert_eq!((finished.fraction(), finished.label("frame").as_str()), (Some(1.0), "tile 3/3"));
    }
}
