//! The fabric's run directory and its lock: one supervisor per fabric name, and how other
//! processes tell whether it runs.
#![forbid(unsafe_code)]

use super::*;

/// The lock that marks a fabric as running. Held for the supervisor's whole life.
pub struct FabricLock {
    _file: File,
    pub(super) dir: PathBuf,
    /// True if the directory held leftovers of a supervisor that died without cleaning up.
    pub stale: bool,
}

/// Takes the fabric's lock, creating its private directory, and removes what a crashed
/// supervisor left behind.
pub fn lock_fabric(name: &str) -> Result<FabricLock, StartError> {
    validate_name(name)?;
    let dir = fabric_dir(name);
    if let Some(root) = dir.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(root)
            .map_err(os(format!("cannot create {}", root.display())))?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(os(format!("cannot create {}", dir.display()))(e)),
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(dir.join(LOCK_FILE))
        .map_err(os("cannot open the fabric lock"))?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => return Err(StartError::AlreadyRunning(name.into())),
        Err(e) => return Err(os("cannot lock the fabric")(e.into())),
    }
    let stale = dir.join(SOCKET_FILE).exists();
    let _ = std::fs::remove_file(dir.join(SOCKET_FILE));
    if stale {
        net::cleanup(name);
    }
    Ok(FabricLock {
        _file: file,
        dir,
        stale,
    })
}

impl FabricLock {
    /// Removes the fabric directory (the lock is released when `self` drops).
    pub fn remove_dir(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// True if some process holds fabric `name`'s lock right now.
pub fn is_running(name: &str) -> bool {
    let Ok(f) = File::open(fabric_dir(name).join(LOCK_FILE)) else {
        return false;
    };
    match rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockShared) {
        Ok(()) => false,
        Err(_) => true,
    }
}
