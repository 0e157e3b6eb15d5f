//! The files a request writes, staged next to their targets and put in place together once the
//! request has succeeded.
//!
//! Each file is first written to a temporary file in its target's own directory, created
//! exclusively under a random name (never following a symbolic link a stranger planted, and on
//! the same file system as the target), and synced. [`Staged::commit`] then renames every one
//! into place: a target that existed is linked aside first and put back if a later rename
//! fails, so a failed commit leaves the directory as it found it, and nothing that the request
//! did not create is ever deleted. Dropping a [`Staged`] without committing removes its
//! temporary files.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use tempfile::NamedTempFile;

use crate::io::IoError;

/// Files staged for one request, in the order they were added.
#[derive(Debug, Default)]
pub struct Staged {
    files: Vec<(NamedTempFile, PathBuf)>,
}

/// The directory a target lives in (`.` for a bare file name).
fn dir_of(target: &Path) -> &Path {
    target.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

fn os(path: &Path) -> impl FnOnce(std::io::Error) -> IoError + '_ {
    move |source| IoError::Os { path: path.to_path_buf(), source }
}

/// A new temporary file in `target`'s directory: exclusive create, random name, mode 0666
/// before the umask (what `File::create` gives the final file).
fn temp_for(target: &Path) -> Result<NamedTempFile, IoError> {
    let name = target
        .file_name()
        .ok_or_else(|| IoError::Format { path: target.to_path_buf(), message: "an output needs a file name".into() })?;
    if target.is_dir() {
        return Err(IoError::Format { path: target.to_path_buf(), message: "is a directory".into() });
    }
    let prefix = format!(".{}.", name.to_string_lossy());
    tempfile::Builder::new()
        .prefix(&prefix)
        .suffix(".tmp")
        .permissions(std::fs::Permissions::from_mode(0o666))
        .tempfile_in(dir_of(target))
        .map_err(os(target))
}

/// An error unless a file can be created beside `target` (its directory exists and is
/// writable) and `target` is not a directory: checked before a request does any work.
pub fn check_writable(target: &Path) -> Result<(), IoError> {
    temp_for(target).map(drop)
}

impl Staged {
    /// Nothing staged yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stages `bytes` for `target`.
    pub fn add(&mut self, target: &Path, bytes: &[u8]) -> Result<(), IoError> {
        let mut file = temp_for(target)?;
        file.write_all(bytes).map_err(os(target))?;
        file.as_file().sync_all().map_err(os(target))?;
        self.files.push((file, target.to_path_buf()));
        Ok(())
    }

    /// Stages the file `write` makes at the path it is given (an external program's output: a
    /// new empty file next to `target`, which it may truncate and rewrite but not replace).
    pub fn add_written_by(
        &mut self,
        target: &Path,
        write: impl FnOnce(&Path) -> Result<(), IoError>,
    ) -> Result<(), IoError> {
        let file = temp_for(target)?;
        write(file.path())?;
        file.as_file().sync_all().map_err(os(target))?;
        self.files.push((file, target.to_path_buf()));
        Ok(())
    }

    /// Stages a file for `target` that the caller (or a program it runs) fills in itself, in
    /// whatever order and as slowly as it likes (a streamed output): a handle to the new empty
    /// file next to `target`, and its path (which may be truncated and rewritten but not
    /// replaced). [`Self::commit`] syncs it before putting it in place.
    pub fn add_open(&mut self, target: &Path) -> Result<(std::fs::File, PathBuf), IoError> {
        let file = temp_for(target)?;
        let handle = file.as_file().try_clone().map_err(os(target))?;
        let path = file.path().to_path_buf();
        self.files.push((file, target.to_path_buf()));
        Ok((handle, path))
    }

    /// Adds the files staged in `other`, after this one's.
    pub fn append(&mut self, mut other: Staged) {
        self.files.append(&mut other.files);
    }

    /// Puts every staged file in place. On an error the targets are as they were before the
    /// call (replaced ones restored, new ones removed) and the error names the target that
    /// failed.
    pub fn commit(self) -> Result<Vec<PathBuf>, IoError> {
        // Files filled in after they were staged ([`Self::add_open`]) reach the disk first.
        for (file, target) in &self.files {
            file.as_file().sync_all().map_err(os(target))?;
        }
        // Targets that exist are linked aside first (the link itself, if it is a symbolic one).
        let mut backups: Vec<Option<PathBuf>> = Vec::with_capacity(self.files.len());
        for (_, target) in &self.files {
            let backup = match std::fs::symlink_metadata(target) {
                Ok(_) => {
                    let aside = tempfile::Builder::new()
                        .prefix(".vae-parallel-previous.")
                        .make_in(dir_of(target), |path| std::fs::hard_link(target, path).map(|()| path.to_path_buf()));
                    match aside {
                        Ok(kept) => Some(kept.into_temp_path().keep().map_err(|e| os(target)(e.error))?),
                        Err(e) => {
                            remove_all(backups.iter().flatten());
                            return Err(os(target)(e));
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => {
                    remove_all(backups.iter().flatten());
                    return Err(os(target)(e));
                }
            };
            backups.push(backup);
        }
        let mut done: Vec<PathBuf> = Vec::with_capacity(self.files.len());
        for (file, target) in self.files {
            if let Err(e) = file.persist(&target) {
                // Undo in reverse: put back what was replaced, remove what was new.
                for (i, placed) in done.iter().enumerate().rev() {
                    match &backups[i] {
                        Some(old) => drop(std::fs::rename(old, placed)),
                        None => drop(std::fs::remove_file(placed)),
                    }
                }
                remove_all(backups[done.len()..].iter().flatten());
                return Err(os(&target)(e.error));
            }
            done.push(target);
        }
        remove_all(backups.iter().flatten());
        Ok(done)
    }
}

fn remove_all<'a>(paths: impl Iterator<Item = &'a PathBuf>) {
    for path in paths {
        let _ = std::fs::remove_file(path);
    }
}

/// Writes `bytes` to `path` atomically: readers see the old file or the whole new one, never a
/// part; a symbolic link at `path` is replaced, not followed.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), IoError> {
    let mut staged = Staged::new();
    staged.add(path, bytes)?;
    staged.commit().map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("vae-output-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn nothing_is_in_place_before_commit_and_nothing_is_left_after_a_drop() {
        let dir = scratch("drop");
        let mut staged = Staged::new();
        staged.add(&dir.join("a.npy"), b"aaa").unwrap();
        staged.add(&dir.join("b.json"), b"bbb").unwrap();
        assert!(!dir.join("a.npy").exists() && !dir.join("b.json").exists());
        drop(staged);
        assert!(names(&dir).is_empty(), "{:?}", names(&dir));
        let mut staged = Staged::new();
        staged.add(&dir.join("a.npy"), b"aaa").unwrap();
        staged.add(&dir.join("b.json"), b"bbb").unwrap();
        assert_eq!(staged.commit().unwrap().len(), 2);
        assert_eq!(names(&dir), ["a.npy", "b.json"]);
        assert_eq!(std::fs::read(dir.join("b.json")).unwrap(), b"bbb");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_planted_symlink_is_replaced_not_followed() {
        let dir = scratch("symlink");
        let victim = dir.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join("out.npy")).unwrap();
        write_atomically(&dir.join("out.npy"), b"decoded").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(!std::fs::symlink_metadata(dir.join("out.npy")).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(dir.join("out.npy")).unwrap(), b"decoded");
        assert_eq!(names(&dir), ["out.npy", "victim"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_commit_restores_what_it_replaced_and_removes_what_it_made() {
        let dir = scratch("restore");
        std::fs::write(dir.join("frame_0000.png"), b"old frame 0").unwrap();
        let mut staged = Staged::new();
        staged.add(&dir.join("frame_0000.png"), b"new frame 0").unwrap();
        staged.add(&dir.join("frame_0001.png"), b"new frame 1").unwrap();
        staged.add(&dir.join("frame_0002.png"), b"new frame 2").unwrap();
        // The last target becomes a directory after staging: its rename fails.
        std::fs::create_dir(dir.join("frame_0002.png")).unwrap();
        std::fs::write(dir.join("frame_0002.png").join("keep"), b"not ours").unwrap();
        let err = staged.commit().unwrap_err();
        assert!(err.to_string().contains("frame_0002.png"), "{err}");
        assert_eq!(std::fs::read(dir.join("frame_0000.png")).unwrap(), b"old frame 0");
        assert!(!dir.join("frame_0001.png").exists());
        assert_eq!(std::fs::read(dir.join("frame_0002.png").join("keep")).unwrap(), b"not ours");
        assert_eq!(names(&dir), ["frame_0000.png", "frame_0002.png"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unwritable_places_are_found_before_any_work() {
        let dir = scratch("check");
        assert!(check_writable(&dir.join("out.npy")).is_ok());
        assert!(names(&dir).is_empty(), "the check leaves nothing behind");
        assert!(check_writable(&dir.join("missing").join("out.npy")).is_err());
        assert!(check_writable(&dir).is_err(), "a directory is not an output file");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
