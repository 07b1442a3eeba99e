//! Completion channels and CQs.

use super::*;

/// `bp_create_comp_channel`.
#[no_mangle]
pub extern "C" fn bp_create_comp_channel(context: *mut BpContext) -> *mut BpCompChannel {
    guard(null_mut(), || {
        local(|l| {
            let ch = get_ctx(l, context as usize)?.ctx.create_comp_channel()?;
            let c = Owned::new(BpCompChannel {
                context,
                fd: ch.as_fd().as_raw_fd(),
                refcnt: 0,
            });
            let p = c.ptr();
            let ctx = context as usize;
            l.insert(c.key(), VObj::Channel(ChObj { c, ch, ctx }), 0);
            Ok(p)
        })
    })
}

/// `bp_destroy_comp_channel`.
#[no_mangle]
pub extern "C" fn bp_destroy_comp_channel(channel: *mut BpCompChannel) -> c_int {
    guard_rc(|| {
        local(|l| {
            get_ch(l, channel as usize)?;
            l.remove(channel as usize, "completion queues")?;
            Ok(())
        })
    })
}

/// `bp_get_cq_event`: blocks until an event; 0 or -1 with errno.
///
/// # Safety
/// `cq` and `cq_context` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn bp_get_cq_event(
    channel: *mut BpCompChannel,
    cq: *mut *mut BpCq,
    cq_context: *mut *mut c_void,
) -> c_int {
    guard(-1, || {
        local(|l| {
            let ch = get_ch(l, channel as usize)?;
            loop {
                let ev = ch.ch.get_cq_event(None)?;
                let found = l.objs.values().find_map(|o| match o {
                    VObj::Cq(c) if c.channel == channel as usize && c.cq.id() == ev.cq_id => {
                        Some(c)
                    }
                    _ => None,
                });
                let Some(c) = found else {
                    continue; // an event for a CQ destroyed since: not the caller's
                };
                c.unacked.set(c.unacked.get().saturating_add(1));
                let p = c.c.ptr();
                if !cq.is_null() {
                    // SAFETY: non-null, and the caller promises it is writable.
                    unsafe { cq.write(p) };
                }
                if !cq_context.is_null() {
                    // SAFETY: `p` is live (registered); C may have written the field, so it
                    // is read through the pointer. `cq_context` is writable (caller).
                    unsafe { cq_context.write((*p).cq_context) };
                }
                return Ok(0);
            }
        })
    })
}

/// `bp_ack_cq_events`.
#[no_mangle]
pub extern "C" fn bp_ack_cq_events(cq: *mut BpCq, nevents: c_uint) {
    guard((), || {
        local(|l| {
            let c = get_cq(l, cq as usize)?;
            c.unacked.set(c.unacked.get().saturating_sub(nevents));
            Ok(())
        })
    })
}

/// `bp_create_cq`.
#[no_mangle]
pub extern "C" fn bp_create_cq(
    context: *mut BpContext,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut BpCompChannel,
    comp_vector: c_int,
) -> *mut BpCq {
    guard(null_mut(), || {
        local(|l| {
            let c = get_ctx(l, context as usize)?;
            if comp_vector != 0 {
                return Err(inval(format!(
                    "comp_vector {comp_vector}: there is one (0)"
                )));
            }
            if cqe <= 0 {
                return Err(inval(format!("cqe {cqe} is not 1..=4194304")));
            }
            let ch = if channel.is_null() {
                None
            } else {
                let ch = get_ch(l, channel as usize)?;
                if ch.ctx != context as usize {
                    return Err(inval("the completion channel belongs to another context"));
                }
                Some(ch)
            };
            let cq = c.ctx.create_cq(cqe as usize, ch.map(|c| &c.ch))?;
            if let Some(ch) = ch {
                // SAFETY: the channel is live (registered); only counters C reads are changed.
                unsafe { (*ch.c.ptr()).refcnt += 1 };
            }
            let h = Owned::new(BpCq {
                context,
                channel,
                cq_context,
                handle: l.serial(),
                cqe,
            });
            let p = h.ptr();
            l.insert(
                h.key(),
                VObj::Cq(CqObj {
                    c: h,
                    cq,
                    ctx: context as usize,
                    channel: channel as usize,
                    unacked: Cell::new(0),
                }),
                0,
            );
            Ok(p)
        })
    })
}

/// `bp_destroy_cq`.
#[no_mangle]
pub extern "C" fn bp_destroy_cq(cq: *mut BpCq) -> c_int {
    guard_rc(|| {
        local(|l| {
            let c = get_cq(l, cq as usize)?;
            if c.unacked.get() > 0 {
                return Err(CErr(
                    libc::EBUSY,
                    format!(
                        "{} completion events of this CQ are not acknowledged (bp_ack_cq_events)",
                        c.unacked.get()
                    ),
                ));
            }
            let channel = c.channel;
            l.remove(cq as usize, "queue pairs")?;
            if let Ok(ch) = get_ch(l, channel) {
                // SAFETY: the channel is live (registered).
                unsafe { (*ch.c.ptr()).refcnt -= 1 };
            }
            Ok(())
        })
    })
}

/// `bp_req_notify_cq`.
#[no_mangle]
pub extern "C" fn bp_req_notify_cq(cq: *mut BpCq, solicited_only: c_int) -> c_int {
    guard_rc(|| {
        local(|l| {
            get_cq(l, cq as usize)?.cq.req_notify(solicited_only != 0)?;
            Ok(())
        })
    })
}

/// `bp_poll_cq`: a count, or -1 with errno.
///
/// # Safety
/// `wc` points to `num_entries` writable `struct bp_wc` (or `num_entries` is 0).
#[no_mangle]
pub unsafe extern "C" fn bp_poll_cq(cq: *mut BpCq, num_entries: c_int, wc: *mut BpWc) -> c_int {
    guard(-1, || {
        local(|l| {
            let c = get_cq(l, cq as usize)?;
            if num_entries < 0 || (num_entries > 0 && wc.is_null()) {
                return Err(inval("num_entries < 0, or wc is NULL"));
            }
            let over = c.cq.overruns();
            if over > 0 {
                return Err(CErr(
                    libc::EOVERFLOW,
                    format!(
                        "CQ overrun: {over} completions arrived while it held its {} entries; \
                         it is in error (as after IBV_EVENT_CQ_ERR): destroy it and size CQs \
                         for every outstanding signaled work request",
                        // SAFETY: the CQ struct is live (registered).
                        unsafe { (*c.c.ptr()).cqe }
                    ),
                ));
            }
            let mut buf = l.wcs.borrow_mut();
            let mut n = 0usize;
            let want = num_entries as usize;
            if want == 0 {
                // Nothing to take, but the poll still moves the CQ's QPs along.
                c.cq.poll(&mut []);
            }
            while n < want {
                let k = c.cq.poll(&mut buf[..(want - n).min(16)]);
                for (i, w) in buf[..k].iter().enumerate() {
                    // SAFETY: n + i < num_entries, and the caller promises that many entries.
                    unsafe { wc.add(n + i).write(wc_out(w)) };
                }
                n += k;
                if k < 16 {
                    break;
                }
            }
            Ok(n as c_int)
        })
    })
}
