//! The shared-memory transport: every node is a process on this host. A grant is the region's
//! memfd, handed over by the supervisor after its checks (owner, PD, QP connection, access
//! flags) and mapped read-only unless the grant is writable; an access is a checked copy or
//! atomic on that mapping.

#![forbid(unsafe_code)]

use std::sync::Arc;

use super::{CopyKind, GrantRequest, PeerState, RemoteRegion, Transport};
use crate::fabric::Fabric;
use crate::mem::{MemError, Region, Span, Word32};
use crate::sync::Ordering;
use crate::wire::registry::{VerbsRequest, VerbsResponse};
use crate::wire::verbs::{MrHeader, MrRepr, MR_DATA_OFF, MR_STATE_OFF, MR_STATE_VALID};

/// The transport of a fabric on one host.
#[derive(Debug, Clone)]
pub struct ShmTransport {
    fabric: Fabric,
}

impl ShmTransport {
    /// The transport of `fabric`.
    pub fn new(fabric: Fabric) -> Self {
        Self { fabric }
    }
}

impl Transport for ShmTransport {
    fn map_region(&self, req: GrantRequest) -> Option<Arc<dyn RemoteRegion>> {
        Some(Arc::new(ShmRegion::grant(&self.fabric, req)?))
    }

    fn peer(&self, slot: u32) -> Option<PeerState> {
        let i = self.fabric.node_info(slot).ok()?;
        Some(PeerState {
            state: i.state,
            generation: i.generation,
        })
    }
}

/// A peer's region mapped in this process.
#[derive(Debug)]
pub struct ShmRegion {
    data: Span,
    state: Word32,
    access: u32,
    ident: (u64, u64),
}

impl ShmRegion {
    /// Asks the supervisor for the grant and maps it: mapped (read-only unless the grant says
    /// writable), populated, its header checked against the grant (length), its state VALID.
    /// `None` when the supervisor refuses or what it hands over fails a check.
    fn grant(fabric: &Fabric, req: GrantRequest) -> Option<Self> {
        let req = match req {
            GrantRequest::ThroughQp { slot, qpn, rkey } => {
                VerbsRequest::MrGrant { slot, qpn, rkey }
            }
            GrantRequest::ForDma { slot, node, rkey } => {
                VerbsRequest::DmaGrant { slot, node, rkey }
            }
        };
        let (resp, fds) = fabric.call_service::<VerbsResponse>(&req, &[]).ok()?;
        let VerbsResponse::MrGranted {
            len,
            access,
            writable,
        } = resp
        else {
            return None;
        };
        let region = Arc::new(Region::map(fds.into_iter().next()?, writable).ok()?);
        region.populate(writable);
        let mut h = [0u8; 64];
        region.read(0, &mut h).ok()?;
        let repr = MrRepr::parse(&MrHeader::new_unchecked(&h[..]), region.len() as u64).ok()?;
        if repr.len != len {
            return None;
        }
        let state = Word32::at(&region, MR_STATE_OFF as u64).ok()?;
        // SYNC POINT mr-state (acquire): a region deregistered before we mapped it is refused.
        if state.load(Ordering::Acquire) != MR_STATE_VALID {
            return None;
        }
        // fstat of a memfd we hold does not fail; if it did, the mapping's address stands in
        // (unique, so two such mappings are never seen as one region).
        let data = Span::new(&region, MR_DATA_OFF, len).ok()?;
        let ident = rustix::fs::fstat(region.fd())
            .map(|s| (s.st_dev, s.st_ino))
            .unwrap_or((u64::MAX, data.addr(0) as u64));
        Some(Self {
            data,
            state,
            access,
            ident,
        })
    }
}

impl RemoteRegion for ShmRegion {
    #[inline]
    fn len(&self) -> u64 {
        self.data.len()
    }
    #[inline]
    fn access_bits(&self) -> u32 {
        self.access
    }
    fn writable(&self) -> bool {
        self.data.writable()
    }
    #[inline]
    fn valid(&self) -> bool {
        // SYNC POINT mr-state (acquire): the owner's deregistration, seen before each access.
        self.state.load(Ordering::Acquire) == MR_STATE_VALID
    }
    fn ident(&self) -> (u64, u64) {
        self.ident
    }
    #[inline]
    fn put(
        &self,
        off: u64,
        src: &Span,
        src_off: u64,
        n: usize,
        how: CopyKind,
    ) -> Result<(), MemError> {
        match how {
            CopyKind::Plain => src.copy_to(src_off, &self.data, off, n),
            CopyKind::Ordered => src.copy_to_ordered(src_off, &self.data, off, n),
            CopyKind::Streaming => src.copy_to_streaming(src_off, &self.data, off, n),
        }
    }
    #[inline]
    fn put_bytes(&self, off: u64, src: &[u8], how: CopyKind) -> Result<(), MemError> {
        match how {
            CopyKind::Ordered => self.data.write_ordered(off, src),
            _ => self.data.write(off, src),
        }
    }
    #[inline]
    fn get(
        &self,
        off: u64,
        dst: &Span,
        dst_off: u64,
        n: usize,
        how: CopyKind,
    ) -> Result<(), MemError> {
        match how {
            CopyKind::Streaming => self.data.copy_to_streaming(off, dst, dst_off, n),
            _ => self.data.copy_to(off, dst, dst_off, n),
        }
    }
    fn fetch_add(&self, off: u64, add: u64) -> Result<u64, MemError> {
        self.data.fetch_add(off, add)
    }
    fn compare_swap(&self, off: u64, compare: u64, swap: u64) -> Result<u64, MemError> {
        self.data.compare_swap(off, compare, swap)
    }
    fn local(&self) -> Option<(&Span, &Word32)> {
        Some((&self.data, &self.state))
    }
}
