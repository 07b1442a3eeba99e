//! Errors and entry-point guards.

use super::*;

pub(crate) fn verbs_errno(e: &VerbsError) -> c_int {
    match e {
        VerbsError::InvalidArgument(_) => libc::EINVAL,
        VerbsError::QueueFull(_) => libc::ENOMEM,
        VerbsError::Post { source, .. } => verbs_errno(source),
        VerbsError::TimedOut => libc::ETIMEDOUT,
        VerbsError::Refused(_) => libc::ECONNREFUSED,
        VerbsError::Fabric(f) => fabric_errno(f),
        VerbsError::Mem(_) => libc::ENOMEM,
        VerbsError::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
    }
}

impl From<VerbsError> for CErr {
    fn from(e: VerbsError) -> Self {
        CErr(verbs_errno(&e), e.to_string())
    }
}

pub(crate) fn inval(m: impl Into<String>) -> CErr {
    CErr(libc::EINVAL, m.into())
}

/// libibverbs' int convention: 0, or the errno value (errno is set as well).
pub(crate) fn guard_rc(f: impl FnOnce() -> Result<(), CErr>) -> c_int {
    let mut code = 0;
    let r = guard(-1, || f().map(|()| 0).inspect_err(|e| code = e.0));
    match r {
        0 => 0,
        // A panic (guard set EIO) leaves `code` at 0.
        _ if code == 0 => libc::EIO,
        _ => code,
    }
}

pub(crate) fn ms(timeout_ms: c_int) -> Result<Option<Duration>, CErr> {
    match timeout_ms {
        -1 => Ok(None),
        t if t >= 0 => Ok(Some(Duration::from_millis(t as u64))),
        t => Err(inval(format!("timeout {t} ms: use -1 (forever) or >= 0"))),
    }
}
