/*
 * The only code that touches UCX's structures: a small C layer over UCP 1.13 so that the
 * Rust side (src/lib.rs) binds plain functions with plain types, and the layouts of UCP's
 * parameter structs, unions and field masks come from <ucp/api/ucp.h> itself and cannot
 * drift. One link = one UCP context, one worker (single-threaded: every call below, and every
 * callback, runs on the thread that calls bpx_progress), an optional listener, and up to
 * BPX_MAX_EPS endpoints named by their index. What happens asynchronously (a peer connected, a
 * message arrived, an endpoint failed) is queued as events and read with bpx_next_event.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <stdarg.h>
#include <pthread.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/socket.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <unistd.h>
#include <ucp/api/ucp.h>
#include <ucs/debug/log_def.h>
#include <ucs/async/async_fwd.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>

#define BPX_MAX_EPS 64
#define BPX_AM_ID 7
#define BPX_MAX_MSG (4 * 1024 * 1024 + 4096)
#define BPX_MAX_INFLIGHT 4096

/* Message buffers of POOL_MIN..POOL_BUF bytes come from a small process-wide pool: glibc hands
 * the top of its heap back to the kernel when a block next to it is freed (trim), so every
 * 64 KiB message a stream received or sent faulted its 16 pages in again (page faults were 7 %
 * of a WRITE stream's time between hosts). Buffers of up to POOL_BIG bytes (a message of one
 * TCP segment: a batch or list of large datagrams) come from a second pool, for the same
 * reason (a stream of 460 KiB messages spent a fifth of its receiver's time faulting pages in).
 * Smaller messages are plain malloc (a pool buffer each would hold 72 KiB for 8 bytes); larger
 * ones are rare. Any thread may free (a received message is freed where the program read it):
 * the pools have a lock. */
#define POOL_MIN (16 * 1024)
#define POOL_BUF (72 * 1024)
#define POOL_MAX 64
#define POOL_BIG (520 * 1024)
#define POOL_BIG_MAX 16

typedef struct buf_head {
    size_t cap;
    size_t pad; /* the payload stays 16-byte aligned, as malloc's */
} buf_head;

typedef struct {
    size_t cap;
    int max;
    int len;
    buf_head **bufs;
} buf_pool;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static buf_head *pool_small[POOL_MAX];
static buf_head *pool_big[POOL_BIG_MAX];
static buf_pool pools[2] = {{POOL_BUF, POOL_MAX, 0, pool_small},
                            {POOL_BIG, POOL_BIG_MAX, 0, pool_big}};

/* The pool for buffers of capacity cap, if any. */
static buf_pool *pool_of(size_t cap)
{
    for (int i = 0; i < 2; i++)
        if (pools[i].cap == cap)
            return &pools[i];
    return NULL;
}

/* A buffer for len bytes (NULL: out of memory); freed with buf_free. */
static void *buf_alloc(size_t len)
{
    size_t cap = len >= POOL_MIN && len <= POOL_BUF   ? POOL_BUF
                 : len > POOL_BUF && len <= POOL_BIG ? POOL_BIG
                 : len                                ? len
                                                      : 1;
    buf_head *h = NULL;
    buf_pool *pool = pool_of(cap);
    if (pool) {
        pthread_mutex_lock(&pool_lock);
        if (pool->len)
            h = pool->bufs[--pool->len];
        pthread_mutex_unlock(&pool_lock);
    }
    if (!h) {
        h = malloc(sizeof *h + cap);
        if (!h)
            return NULL;
        h->cap = cap;
    }
    return h + 1;
}

static void buf_free(void *p)
{
    if (!p)
        return;
    buf_head *h = (buf_head *)p - 1;
    buf_pool *pool = pool_of(h->cap);
    if (pool) {
        pthread_mutex_lock(&pool_lock);
        if (pool->len < pool->max) {
            pool->bufs[pool->len++] = h;
            h = NULL;
        }
        pthread_mutex_unlock(&pool_lock);
    }
    free(h);
}

enum { BPX_EV_ACCEPTED = 1, BPX_EV_MESSAGE = 2, BPX_EV_FAILED = 3, BPX_EV_DROPPED = 4 };

typedef struct bpx_event {
    int kind;
    int ep;
    int status;
    size_t len;
    void *data;
} bpx_event;

struct bpx_link;

typedef struct bpx_ep {
    struct bpx_link *link;
    int index;
    ucp_ep_h ep;
    /* Being closed: the progress that completes a close may accept a connection, which must
     * not take this slot (its events would be dropped as the closed endpoint's). */
    int closing;
    /* Its lanes are being wired (a flush asked after it was made, this request, has not
     * completed): the link's progress runs in the host's namespace meanwhile (see host_ns). */
    int settling;
    void *settle_req;
    /* Small messages sent on it (counted up to ONE_BUFFER_AFTER) and whether they go in one
     * buffer (see bpx_send_ready). */
    unsigned small_sent;
    int one_buffer;
} bpx_ep;

typedef struct bpx_link {
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_listener_h listener;
    bpx_ep eps[BPX_MAX_EPS];
    bpx_event *q;
    size_t qhead, qlen, qcap;
    size_t inflight;
    size_t inflight_bytes;
    int half_closed;
    int efd;
    int flushing; /* a worker flush is in flight (bpx_idle) */
    int settling; /* endpoints whose lanes are being wired (bpx_ep.settling) */
    /* During bpx_progress_with: offered each message in place before it is copied (1: taken). */
    int (*deliver)(void *ctx, int from, const void *data, size_t len);
    void *deliver_ctx;
    /* A small message's block that UCX sent at once (SPARE_CAP bytes of payload), kept for
     * the next small message: see bpx_send_alloc. */
    void *spare;
} bpx_link;


/* The network namespace UCX's sockets belong in, when the process runs in another (-1: the
 * thread's own). A program in a node's namespace (bp0 and lo) on a fabric across hosts cannot
 * reach the other hosts from there; its endpoints' UCX works in the host's namespace instead:
 * the calls that make sockets - the context and its listener, connecting, accepting, and the
 * progress that wires a new endpoint's lanes (UCX makes their sockets there: "Network is
 * unreachable" from the node's namespace) - run with the thread moved into the host's
 * namespace and back (setns: ~1.7 us a pair here), every other call as it is. A socket keeps
 * the namespace it was made in, so what flows later needs no move. */
static int host_ns = -1;

/* Sets the host's namespace (an fd the shim keeps; -1: none); before any link opens. 0. */
int bpx_set_host_netns(int fd)
{
    if (host_ns >= 0)
        close(host_ns);
    host_ns = fd;
    return 0;
}

/* Moves this thread into the host's namespace: the fd of its own to come back with, -1 when
 * there is no host's namespace to go to, -2 when the move failed (errno). */
static int enter_host(void)
{
    if (host_ns < 0)
        return -1;
    int own = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
    if (own < 0)
        return -2;
    if (setns(host_ns, CLONE_NEWNET)) {
        close(own);
        return -2;
    }
    return own;
}

/* UCX's async thread (one a process, made by the first context that needs it, in that thread's
 * namespace) handles the sockets' events of every UCX context in the process. A program that
 * started its own UCX first - one running UCX over the drop-in libibverbs in a node's namespace
 * - made it in the node's namespace, and the links' endpoints never connected (the first SEND
 * of a pair between hosts never left the process; a UCP worker made first by a C program did
 * the same). So, once, with a host's namespace to go to, the thread is asked to move there: an
 * eventfd handler without an async context runs on that thread itself (never from another
 * thread's progress), and it setns()es and says so. The program's own UCX then has its async
 * thread in the host's namespace too: sockets it makes there are the host's. */
static int async_moved = 0;

static void move_async_thread(int id, ucs_event_set_types_t events, void *arg)
{
    (void)events;
    uint64_t v;
    if (read(id, &v, sizeof v) < 0) {
        /* (Nothing to read: another wake-up; the handler stays for the write.) */
    }
    int *done = arg;
    int ok = host_ns >= 0 && setns(host_ns, CLONE_NEWNET) == 0;
    __atomic_store_n(done, ok ? 1 : -1, __ATOMIC_RELEASE);
}

/* Moves UCX's async thread into the host's namespace once (see async_moved); before a link's
 * context is made. Best effort: the link works as before if it cannot. */
static pthread_mutex_t async_moving = PTHREAD_MUTEX_INITIALIZER;
static void async_thread_to_host_locked(void);

static void async_thread_to_host(void)
{
    if (host_ns < 0 || __atomic_load_n(&async_moved, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&async_moving);
    if (!__atomic_load_n(&async_moved, __ATOMIC_ACQUIRE))
        async_thread_to_host_locked();
    pthread_mutex_unlock(&async_moving);
}

static void async_thread_to_host_locked(void)
{
    int efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (efd < 0)
        return;
    static int done;
    __atomic_store_n(&done, 0, __ATOMIC_RELEASE);
    if (ucs_async_set_event_handler(UCS_ASYNC_MODE_THREAD_SPINLOCK, efd, UCS_EVENT_SET_EVREAD,
                                    move_async_thread, &done, NULL) != UCS_OK) {
        close(efd);
        return;
    }
    uint64_t one = 1;
    if (write(efd, &one, sizeof one) == sizeof one) {
        /* The thread answers within microseconds; 1 s at most. */
        for (int i = 0; i < 100000 && !__atomic_load_n(&done, __ATOMIC_ACQUIRE); i++)
            usleep(10);
    }
    ucs_async_remove_handler(efd, 1);
    close(efd);
    __atomic_store_n(&async_moved, 1, __ATOMIC_RELEASE);
}

/* Back from enter_host (what it returned). */
static void leave_host(int own)
{
    if (own >= 0) {
        (void)setns(own, CLONE_NEWNET);
        close(own);
    }
}

/* The interface holding IPv4 address a in this thread's namespace: its index and name (0:
 * none). */
static unsigned interface_of(const struct in_addr *a, char name[IF_NAMESIZE])
{
    struct ifaddrs *all;
    if (getifaddrs(&all))
        return 0;
    unsigned index = 0;
    for (struct ifaddrs *i = all; i && !index; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET)
            continue;
        if (((struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr != a->s_addr)
            continue;
        snprintf(name, IF_NAMESIZE, "%s", i->ifa_name);
        index = if_nametoindex(name);
    }
    freeifaddrs(all);
    return index;
}

/* The index /sys/class/net/NAME/ifindex gives (0: none). */
static unsigned sysfs_index(const char *name)
{
    char path[64 + IF_NAMESIZE];
    snprintf(path, sizeof path, "/sys/class/net/%s/ifindex", name);
    FILE *f = fopen(path, "re");
    if (!f)
        return 0;
    unsigned index = 0;
    if (fscanf(f, "%u", &index) != 1)
        index = 0;
    fclose(f);
    return index;
}

/* 1 if ip (IPv4) is an address of the namespace UCX's sockets are made in (a UDP socket binds
 * there) that UCX can use, 0 if not, a negative status on a bad address. */
int bpx_addr_is_local(const char *ip)
{
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    if (inet_pton(AF_INET, ip, &sa.sin_addr) != 1)
        return UCS_ERR_INVALID_PARAM;
    int own = enter_host();
    if (own == -2)
        return 0;
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    char name[IF_NAMESIZE] = "";
    unsigned index = 0;
    if (own >= 0)
        index = interface_of(&sa.sin_addr, name);
    leave_host(own);
    if (fd < 0)
        return 0;
    int ok = bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    close(fd);
    /* UCX finds its interfaces in /sys/class/net, which shows the namespace of whoever
     * mounted it: after `ip netns exec` into a node's namespace, the node's (bp0, lo), and UCX
     * working from the host's would find lo alone there, listen all the same and never reach
     * the other host. Only when the host's interface is there as in the host's namespace. */
    if (ok && own >= 0)
        ok = index && sysfs_index(name) == index;
    return ok;
}

static void push(bpx_link *l, bpx_event ev)
{
    if (l->qlen == l->qcap) {
        size_t cap = l->qcap ? l->qcap * 2 : 64;
        bpx_event *q = malloc(cap * sizeof *q);
        if (!q) {
            buf_free(ev.data);
            return;
        }
        for (size_t i = 0; i < l->qlen; i++)
            q[i] = l->q[(l->qhead + i) % l->qcap];
        free(l->q);
        l->q = q;
        l->qhead = 0;
        l->qcap = cap;
    }
    l->q[(l->qhead + l->qlen) % l->qcap] = ev;
    l->qlen++;
}

static int free_index(bpx_link *l)
{
    for (int i = 0; i < BPX_MAX_EPS; i++)
        if (!l->eps[i].ep && !l->eps[i].closing)
            return i;
    return -1;
}

static void ep_failed(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    bpx_ep *e = arg;
    (void)ep;
    bpx_event ev = {BPX_EV_FAILED, e->index, status, 0, NULL};
    push(e->link, ev);
}

static void set_err_handling(ucp_ep_params_t *p, bpx_ep *e)
{
    p->field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p->err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p->err_handler.cb = ep_failed;
    p->err_handler.arg = e;
}

/* The endpoint no longer settles (its lanes are wired, or it is closed). */
static void unsettle(bpx_ep *e)
{
    if (e->settling) {
        e->settling = 0;
        e->settle_req = NULL;
        e->link->settling--;
    }
}

static void settled(void *request, ucs_status_t status, void *user_data)
{
    bpx_ep *e = user_data;
    (void)status;
    /* (A flush of a closed endpoint whose slot a new one took is not the new one's.) */
    if (e->settle_req == request)
        unsettle(e);
    ucp_request_free(request);
}

/* A new endpoint's lanes are wired by later progress, which makes their sockets: with a host's
 * namespace, that progress runs there until a flush of the endpoint completes (it waits for
 * the lanes). */
static void settle(bpx_ep *e)
{
    if (host_ns < 0 || !e->ep)
        return;
    ucp_request_param_t p;
    memset(&p, 0, sizeof p);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = settled;
    p.user_data = e;
    ucs_status_ptr_t r = ucp_ep_flush_nbx(e->ep, &p);
    if (UCS_PTR_IS_PTR(r) && !e->settling) {
        e->settling = 1;
        e->settle_req = r;
        e->link->settling++;
    }
}

/* ucp_worker_progress, in the host's namespace while an endpoint settles. */
static unsigned progress(bpx_link *l)
{
    if (!l->settling)
        return ucp_worker_progress(l->worker);
    int own = enter_host();
    unsigned n = ucp_worker_progress(l->worker);
    leave_host(own);
    return n;
}

/* A slot takes a new endpoint (made by bpx_connect or accepted): counted afresh, then settled. */
static void opened(bpx_ep *e, ucp_ep_h ep)
{
    e->ep = ep;
    e->small_sent = 0;
    e->one_buffer = 0;
    settle(e);
}

static void on_conn_request(ucp_conn_request_h req, void *arg)
{
    bpx_link *l = arg;
    int i = free_index(l);
    if (i < 0) {
        ucp_listener_reject(l->listener, req);
        return;
    }
    ucp_ep_params_t p;
    memset(&p, 0, sizeof p);
    p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
    p.conn_request = req;
    set_err_handling(&p, &l->eps[i]);
    ucp_ep_h ep;
    int own = enter_host();
    if (own == -2) {
        ucp_listener_reject(l->listener, req);
        return;
    }
    ucs_status_t s = ucp_ep_create(l->worker, &p, &ep);
    leave_host(own);
    if (s != UCS_OK)
        return;
    opened(&l->eps[i], ep);
    bpx_event ev = {BPX_EV_ACCEPTED, i, 0, 0, NULL};
    push(l, ev);
}

static int index_of(bpx_link *l, ucp_ep_h ep)
{
    for (int i = 0; i < BPX_MAX_EPS; i++)
        if (ep && l->eps[i].ep == ep)
            return i;
    return -1;
}

static ucs_status_t on_message(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param)
{
    bpx_link *l = arg;
    (void)header;
    (void)header_length;
    int from = -1;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)
        from = index_of(l, param->reply_ep);
    /* Eager data is in `data` for the call (FLAG_DATA only says it could be kept longer). */
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || length > BPX_MAX_MSG) {
        /* A rendezvous message: our senders force eager, so this is not one of ours. */
        bpx_event ev = {BPX_EV_DROPPED, from, 0, length, NULL};
        push(l, ev);
        return UCS_OK;
    }
    /* Offered in place first (only while no event waits: what is queued came before). */
    if (l->deliver && l->qlen == 0 && l->deliver(l->deliver_ctx, from, data, length))
        return UCS_OK;
    void *copy = buf_alloc(length);
    if (!copy)
        return UCS_OK;
    memcpy(copy, data, length);
    bpx_event ev = {BPX_EV_MESSAGE, from, 0, length, copy};
    push(l, ev);
    return UCS_OK;
}

/* UCX logs to stdout unless UCX_LOG_FILE says otherwise, and a program's stdout is its own
 * (`perf --json` printed a UCX warning into its JSON): UCX's messages go to stderr instead. */
static ucs_log_func_rc_t log_to_stderr(const char *file, unsigned line, const char *function,
                                       ucs_log_level_t level,
                                       const ucs_log_component_config_t *comp_conf,
                                       const char *message, va_list ap)
{
    (void)function;
    if (!ucs_log_component_is_enabled(level, comp_conf) && level != UCS_LOG_LEVEL_PRINT)
        return UCS_LOG_FUNC_RC_CONTINUE;
    char text[1024];
    va_list aq;
    va_copy(aq, ap);
    vsnprintf(text, sizeof text, message, aq);
    va_end(aq);
    const char *base = strrchr(file, '/');
    fprintf(stderr, "UCX %s %s:%u %s\n", ucs_log_level_names[level], base ? base + 1 : file,
            line, text);
    return UCS_LOG_FUNC_RC_STOP;
}

/* Sends UCX's log to stderr unless the user chose where it goes (UCX_LOG_FILE). Call once,
 * before the first context. */
void bpx_log_to_stderr(void)
{
    if (!getenv("UCX_LOG_FILE"))
        ucs_log_push_handler(log_to_stderr);
}

const char *bpx_status_string(int status)
{
    return ucs_status_string((ucs_status_t)status);
}

static int parse_addr(const char *ip, uint16_t port, struct sockaddr_in *sa)
{
    memset(sa, 0, sizeof *sa);
    sa->sin_family = AF_INET;
    sa->sin_port = htons(port);
    return inet_pton(AF_INET, ip, &sa->sin_addr) == 1 ? 0 : UCS_ERR_INVALID_ADDR;
}

void bpx_close_all(bpx_link *l);

/* Opens a link; listens on ip:port when ip is not NULL (port 0: any). With no_shm, and
 * UCX_TLS unset, UCX is not offered its shared-memory transports. Unless UCX_ZCOPY_THRESH is
 * set, messages from 16 KiB go zero-copy (over TCP: sendmsg from our buffer, which lives until
 * the send completes, instead of a copy into UCX's): 64 KiB datagrams between two hosts
 * 1.10-1.27x (8 alternating pairs, median 1.12). (Set in this context's configuration, not
 * the environment, which programs we start - ucx_perftest beside perf - would inherit.) */
static int open_link(const char *ip, uint16_t port, int no_shm, bpx_link **out);
int bpx_open(const char *ip, uint16_t port, int no_shm, bpx_link **out)
{
    /* (The context finds its devices, the worker and listener make their sockets, in the
     * host's namespace; UCX's progress thread, if this starts it, lives there too.) */
    int own = enter_host();
    if (own == -2)
        return UCS_ERR_IO_ERROR;
    async_thread_to_host();
    int r = open_link(ip, port, no_shm, out);
    leave_host(own);
    return r;
}

static int open_link(const char *ip, uint16_t port, int no_shm, bpx_link **out)
{
    bpx_link *l = calloc(1, sizeof *l);
    if (!l)
        return UCS_ERR_NO_MEMORY;
    l->efd = -1;
    for (int i = 0; i < BPX_MAX_EPS; i++) {
        l->eps[i].link = l;
        l->eps[i].index = i;
    }
    ucp_params_t p;
    memset(&p, 0, sizeof p);
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    ucp_config_t *cfg = NULL;
    ucs_status_t s = ucp_config_read(NULL, NULL, &cfg);
    if (s != UCS_OK)
        goto fail;
    /* Bit 1 of no_shm: the process's UCX_* variables are its program's (a program over the
     * drop-in libibverbs naming the fabric's device for its own UCX): the link takes
     * BACKPLANE_UCX_TLS / BACKPLANE_UCX_NET_DEVICES, or UCX's defaults, instead. */
    int program_env = no_shm & 2;
    no_shm &= 1;
    const char *tls = getenv("BACKPLANE_UCX_TLS");
    const char *devs = getenv("BACKPLANE_UCX_NET_DEVICES");
    if (tls)
        s = ucp_config_modify(cfg, "TLS", tls);
    else if (program_env)
        s = ucp_config_modify(cfg, "TLS", no_shm ? "^sm" : "all");
    else if (no_shm && !getenv("UCX_TLS"))
        s = ucp_config_modify(cfg, "TLS", "^sm");
    if (s == UCS_OK && (devs || program_env))
        s = ucp_config_modify(cfg, "NET_DEVICES", devs ? devs : "all");
    if (s == UCS_OK && !getenv("UCX_ZCOPY_THRESH"))
        s = ucp_config_modify(cfg, "ZCOPY_THRESH", "16384");
    if (s != UCS_OK) {
        ucp_config_release(cfg);
        goto fail;
    }
    s = ucp_init(&p, cfg, &l->ctx);
    if (cfg)
        ucp_config_release(cfg);
    if (s != UCS_OK)
        goto fail;
    ucp_worker_params_t wp;
    memset(&wp, 0, sizeof wp);
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    /* One thread at a time, not always the same one: a datagram endpoint's link moves with
     * the endpoint between threads (Rust: Send, not Sync). */
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    s = ucp_worker_create(l->ctx, &wp, &l->worker);
    if (s != UCS_OK)
        goto fail;
    ucp_am_handler_param_t hp;
    memset(&hp, 0, sizeof hp);
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = BPX_AM_ID;
    hp.cb = on_message;
    hp.arg = l;
    s = ucp_worker_set_am_recv_handler(l->worker, &hp);
    if (s != UCS_OK)
        goto fail;
    s = ucp_worker_get_efd(l->worker, &l->efd);
    if (s != UCS_OK)
        goto fail;
    if (ip) {
        struct sockaddr_in sa;
        s = parse_addr(ip, port, &sa);
        if (s != UCS_OK)
            goto fail;
        ucp_listener_params_t lp;
        memset(&lp, 0, sizeof lp);
        lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
        lp.sockaddr.addr = (const struct sockaddr *)&sa;
        lp.sockaddr.addrlen = sizeof sa;
        lp.conn_handler.cb = on_conn_request;
        lp.conn_handler.arg = l;
        s = ucp_listener_create(l->worker, &lp, &l->listener);
        if (s != UCS_OK)
            goto fail;
    }
    *out = l;
    return UCS_OK;
fail:
    bpx_close_all(l);
    return s;
}

/* The port the listener listens on (0 without a listener). */
int bpx_listen_port(bpx_link *l)
{
    if (!l->listener)
        return 0;
    ucp_listener_attr_t a;
    memset(&a, 0, sizeof a);
    a.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if (ucp_listener_query(l->listener, &a) != UCS_OK)
        return 0;
    if (a.sockaddr.ss_family == AF_INET)
        return ntohs(((struct sockaddr_in *)&a.sockaddr)->sin_port);
    if (a.sockaddr.ss_family == AF_INET6)
        return ntohs(((struct sockaddr_in6 *)&a.sockaddr)->sin6_port);
    return 0;
}

int bpx_efd(bpx_link *l)
{
    return l->efd;
}

/* Starts connecting to ip:port; returns the endpoint's index or a negative status. Failure to
 * connect arrives later as a FAILED event. */
int bpx_connect(bpx_link *l, const char *ip, uint16_t port)
{
    int i = free_index(l);
    if (i < 0)
        return UCS_ERR_EXCEEDS_LIMIT;
    struct sockaddr_in sa;
    ucs_status_t s = parse_addr(ip, port, &sa);
    if (s != UCS_OK)
        return s;
    ucp_ep_params_t p;
    memset(&p, 0, sizeof p);
    p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
    p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    p.sockaddr.addr = (const struct sockaddr *)&sa;
    p.sockaddr.addrlen = sizeof sa;
    set_err_handling(&p, &l->eps[i]);
    ucp_ep_h ep;
    int own = enter_host();
    if (own == -2)
        return UCS_ERR_IO_ERROR;
    s = ucp_ep_create(l->worker, &p, &ep);
    leave_host(own);
    if (s != UCS_OK)
        return s;
    opened(&l->eps[i], ep);
    return i;
}

/* A message's block: this header, then the payload. */
typedef struct bpx_block {
    bpx_link *link;
    size_t len;
    ucp_dt_iov_t iov; /* the payload, as a one-piece list (see bpx_send_ready) */
} bpx_block;

static void sent(void *request, ucs_status_t status, void *user_data)
{
    bpx_block *b = user_data;
    (void)status;
    b->link->inflight--;
    b->link->inflight_bytes -= b->len;
    buf_free(b);
    ucp_request_free(request);
}

/* The payload capacity of a small message's block, which a link keeps one of between sends:
 * most small messages (a queue pair's ring bytes, an answer, a latency test's datagram) go out
 * at once, and the malloc before each cost 85-210 cycles of a reply's turnaround between
 * hosts (46-58 with the spare: session 39's probe of perf dgram-lat; its free came after the
 * send). */
#define SPARE_CAP 2048

/* A message of len bytes to fill and pass to bpx_send_ready (or bpx_send_cancel); NULL if it
 * cannot go now, with *status saying why (UCS_ERR_NO_RESOURCE: too much in flight). */
void *bpx_send_alloc(bpx_link *l, int index, size_t len, int *status)
{
    *status = UCS_OK;
    if (index < 0 || index >= BPX_MAX_EPS || !l->eps[index].ep)
        *status = UCS_ERR_INVALID_PARAM;
    else if (len > BPX_MAX_MSG)
        *status = UCS_ERR_MESSAGE_TRUNCATED;
    else if (l->inflight >= BPX_MAX_INFLIGHT)
        *status = UCS_ERR_NO_RESOURCE;
    if (*status != UCS_OK)
        return NULL;
    /* The header, then the payload: the completion callback frees both (a small one sent at
     * once is kept as the link's spare instead). */
    bpx_block *block;
    if (len <= SPARE_CAP && l->spare) {
        block = l->spare;
        l->spare = NULL;
    } else {
        block = buf_alloc(sizeof(bpx_block) + (len <= SPARE_CAP ? SPARE_CAP : len));
    }
    if (!block) {
        *status = UCS_ERR_NO_MEMORY;
        return NULL;
    }
    block->link = l;
    block->len = 0;
    return block + 1;
}

/* Frees a message from bpx_send_alloc that is not sent after all. */
void bpx_send_cancel(void *payload)
{
    buf_free((bpx_block *)payload - 1);
}

/* After this many small messages on an endpoint its lanes are wired (they may change until
 * then): whether its small messages go in one buffer is decided once, there. */
#define ONE_BUFFER_AFTER 32

/* Whether the active-message lane in ucp_ep_print_info's text is UCX's TCP transport: the lane
 * whose uses (after "->") include the word "am", e.g. "lane[0]:  1:tcp/veth0.0 md[1] -> md[1]/
 * tcp/sysdev[255] rma_bw#0 am am_bw#0". text is cut into lines in place. */
int bpx_text_am_lane_is_tcp(char *text)
{
    int tcp = 0;
    for (char *line = text; line && *line && !tcp;) {
        char *end = strchr(line, '\n');
        if (end)
            *end = 0;
        const char *lane = strstr(line, "lane[");
        char *arrow = lane ? strstr(lane, "->") : NULL;
        if (arrow) {
            int am = 0;
            char *save = NULL;
            *arrow = 0;
            for (char *w = strtok_r(arrow + 2, " \t", &save); w && !am; w = strtok_r(NULL, " \t", &save))
                am = strcmp(w, "am") == 0;
            /* "lane[0]:  1:tcp/...": the transport follows the second colon. */
            const char *colon = strchr(lane, ':');
            const char *tl = colon ? strchr(colon + 1, ':') : NULL;
            tcp = am && tl && strncmp(tl + 1, "tcp/", 4) == 0;
        }
        line = end ? end + 1 : NULL;
    }
    return tcp;
}

/* Whether the endpoint's active-message lane is UCX's TCP transport. */
static int am_lane_is_tcp(ucp_ep_h ep)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f)
        return 0;
    ucp_ep_print_info(ep, f);
    fclose(f);
    int tcp = text ? bpx_text_am_lane_is_tcp(text) : 0;
    free(text);
    return tcp;
}

/* Sends the first len bytes of a message from bpx_send_alloc (which owns it from here, sent
 * or not). 0 or a negative status. */
int bpx_send_ready(bpx_link *l, int index, void *payload, size_t len)
{
    bpx_block *block = (bpx_block *)payload - 1;
    if (index < 0 || index >= BPX_MAX_EPS || !l->eps[index].ep) {
        buf_free(block);
        return UCS_ERR_INVALID_PARAM;
    }
    ucp_request_param_t p;
    memset(&p, 0, sizeof p);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    p.cb.send = sent;
    p.user_data = block;
    bpx_ep *e = &l->eps[index];
    if (len <= SPARE_CAP && e->small_sent < ONE_BUFFER_AFTER &&
        ++e->small_sent == ONE_BUFFER_AFTER)
        e->one_buffer = am_lane_is_tcp(e->ep);
    ucs_status_ptr_t r;
    if (len <= SPARE_CAP && e->one_buffer) {
        /* Over TCP, UCP sends a small active message with sendmsg of four pieces (its
         * transport's header, UCP's, the payload, the reply footer), where its tagged
         * messages go with one send of a buffer they were copied into; in the kernel the
         * pieces cost ~0.2 us a message between two namespaces (ucp_am_lat 4.92 us one way
         * against tag_lat's 4.70, 4 of 4 pairs). A payload given as a list makes UCP copy
         * the message into one buffer (bcopy) and send that. */
        block->iov.buffer = payload;
        block->iov.length = len;
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
        p.datatype = ucp_dt_make_iov();
        r = ucp_am_send_nbx(e->ep, BPX_AM_ID, NULL, 0, &block->iov, 1, &p);
    } else {
        r = ucp_am_send_nbx(e->ep, BPX_AM_ID, NULL, 0, payload, len, &p);
    }
    if (r == NULL) {
        /* (Sent: UCX holds nothing of it. buf_alloc gave a small block exactly SPARE_CAP.) */
        if (!l->spare && ((buf_head *)block - 1)->cap == sizeof(bpx_block) + SPARE_CAP)
            l->spare = block;
        else
            buf_free(block);
        return 0;
    }
    if (UCS_PTR_IS_ERR(r)) {
        buf_free(block);
        return UCS_PTR_STATUS(r);
    }
    block->len = len;
    l->inflight++;
    l->inflight_bytes += len;
    return 0;
}

/* 1 if the worker holds nothing unsent (a message completes once UCX copied it, possibly
 * into a transport's buffer it has not written out yet: only a flush says all left). */
static void flushed(void *request, ucs_status_t status, void *user_data)
{
    bpx_link *l = user_data;
    (void)status;
    l->flushing = 0;
    ucp_request_free(request);
}

int bpx_idle(bpx_link *l)
{
    /* One flush at a time: each one in flight holds a reference on an endpoint, and UCX 1.13
     * aborts past 255 of them (flush.c, `refcount < 255`: seen when a burst of READ requests
     * between hosts kept a slow connection busy while every send asked again). */
    if (l->flushing)
        return 0;
    ucp_request_param_t p;
    memset(&p, 0, sizeof p);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = flushed;
    p.user_data = l;
    ucs_status_ptr_t r = ucp_worker_flush_nbx(l->worker, &p);
    if (r == NULL || UCS_PTR_IS_ERR(r))
        return 1;
    l->flushing = 1; /* the request is freed by `flushed` */
    return 0;
}

/* Bytes of messages handed to UCX and not sent yet. */
size_t bpx_inflight_bytes(bpx_link *l)
{
    return l->inflight_bytes;
}

/* Sends one message made of head then buf (copied: the caller's buffers are free on return).
 * 0 or a negative status. */
int bpx_send2(bpx_link *l, int index, const void *head, size_t hlen, const void *buf, size_t blen)
{
    int status;
    char *payload = bpx_send_alloc(l, index, hlen + blen, &status);
    if (!payload)
        return status;
    if (hlen)
        memcpy(payload, head, hlen);
    if (blen)
        memcpy(payload + hlen, buf, blen);
    return bpx_send_ready(l, index, payload, hlen + blen);
}

/* A piece of a message that UCX reads in place (bpx_send_iov). */
typedef struct {
    const void *buf;
    size_t len;
} bpx_piece;

/* At most this many pieces in one message (UCX's TCP transport sends up to UCX_TCP_MAX_IOV
 * iovs in one sendmsg and splits a longer list into several). */
#define BPX_MAX_PIECES 64

/* A message made of a header, pieces read in place and a tail (bpx_send_iov): its iovs, then
 * the header and tail bytes. */
typedef struct {
    bpx_link *link;
    size_t len;
    void (*release)(void *);
    void *token;
    size_t n;
    ucp_dt_iov_t iov[]; /* n + 2, read by UCX until the send completes */
} bpx_iov_msg;

static void sent_iov(void *request, ucs_status_t status, void *user_data)
{
    bpx_iov_msg *m = user_data;
    (void)status;
    m->link->inflight--;
    m->link->inflight_bytes -= m->len;
    m->release(m->token);
    free(m);
    ucp_request_free(request);
}

/* Sends one message made of head (copied), the n pieces, which UCX reads in place, and tail
 * (copied): the pieces must stay valid and unchanged until release(token) is called (at once
 * if the message went or failed before this returns, else from the progress that completes
 * it). release is called exactly once. 0 or a negative status. */
int bpx_send_iov(bpx_link *l, int index, const void *head, size_t hlen, const bpx_piece *pieces,
                 size_t n, const void *tail, size_t tlen, void (*release)(void *), void *token)
{
    int status = UCS_OK;
    size_t total = hlen + tlen;
    for (size_t i = 0; i < n && i < BPX_MAX_PIECES; i++)
        total += pieces[i].len;
    if (index < 0 || index >= BPX_MAX_EPS || !l->eps[index].ep)
        status = UCS_ERR_INVALID_PARAM;
    else if (n > BPX_MAX_PIECES)
        status = UCS_ERR_INVALID_PARAM;
    else if (total > BPX_MAX_MSG)
        status = UCS_ERR_MESSAGE_TRUNCATED;
    else if (l->inflight >= BPX_MAX_INFLIGHT)
        status = UCS_ERR_NO_RESOURCE;
    bpx_iov_msg *m =
        status == UCS_OK ? malloc(sizeof *m + (n + 2) * sizeof(ucp_dt_iov_t) + hlen + tlen) : NULL;
    if (status == UCS_OK && !m)
        status = UCS_ERR_NO_MEMORY;
    if (status != UCS_OK) {
        release(token);
        return status;
    }
    char *h = (char *)&m->iov[n + 2];
    memcpy(h, head, hlen);
    if (tlen)
        memcpy(h + hlen, tail, tlen);
    m->link = l;
    m->len = 0;
    m->release = release;
    m->token = token;
    m->n = n;
    m->iov[0].buffer = h;
    m->iov[0].length = hlen;
    for (size_t i = 0; i < n; i++) {
        m->iov[i + 1].buffer = (void *)pieces[i].buf;
        m->iov[i + 1].length = pieces[i].len;
    }
    m->iov[n + 1].buffer = h + hlen;
    m->iov[n + 1].length = tlen;
    ucp_request_param_t p;
    memset(&p, 0, sizeof p);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_DATATYPE;
    p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    p.datatype = ucp_dt_make_iov();
    p.cb.send = sent_iov;
    p.user_data = m;
    ucs_status_ptr_t r = ucp_am_send_nbx(l->eps[index].ep, BPX_AM_ID, NULL, 0, m->iov, n + 1 + (tlen != 0), &p);
    if (r == NULL || UCS_PTR_IS_ERR(r)) {
        release(token);
        free(m);
        return r == NULL ? 0 : UCS_PTR_STATUS(r);
    }
    m->len = total;
    l->inflight++;
    l->inflight_bytes += total;
    return 0;
}

/* Sends one message made of head (copied), the blen bytes at body, which UCX reads in place,
 * and tail (copied): bpx_send_iov with one piece. */
int bpx_send_zc(bpx_link *l, int index, const void *head, size_t hlen, const void *body,
                size_t blen, const void *tail, size_t tlen, void (*release)(void *), void *token)
{
    bpx_piece piece = {body, blen};
    return bpx_send_iov(l, index, head, hlen, &piece, 1, tail, tlen, release, token);
}

/* Whether this thread is UCX's async thread (ucs_pthread_create names it "async"): a program's
 * own UCX calls into the drop-in libibverbs from there (OpenMPI over UCX's UD transport polls
 * its CQs from that thread), and a progress of one of our workers there that finds an endpoint
 * failed - a peer process gone at the end of an MPI run between hosts - makes UCX 1.13 abort
 * the program (ucp_ep.c:1358, `!ucs_async_is_from_async(...)`: 2 of 6 runs of the hosts suite
 * in session 48, from ibv_poll_cq's look at a UD QP's endpoint). Such a look leaves
 * the network to the program's other threads and ours (the endpoints' wakers, the pairs'
 * threads). Asked once a thread. */
static int on_ucx_async_thread(void)
{
    static __thread int known = -1;
    if (known < 0) {
        char name[16] = {0};
        known = prctl(PR_GET_NAME, name, 0, 0, 0) == 0 && strcmp(name, "async") == 0;
    }
    return known;
}

/* Makes progress; returns how much happened (0: nothing). */
int bpx_progress(bpx_link *l)
{
    return (int)progress(l);
}

/* bpx_progress for a look that may find nothing (a poll, a sender's look after a send): none
 * on UCX's async thread (see on_ucx_async_thread). The loops that wait for UCX to let go of a
 * send use bpx_progress, wherever they run. */
int bpx_look(bpx_link *l)
{
    if (on_ucx_async_thread())
        return 0;
    return (int)progress(l);
}

/* bpx_look, offering each message that comes while no event waits to `deliver` in place
 * (valid for the call only); one it takes (returns 1) is neither copied nor queued. */
int bpx_progress_with(bpx_link *l, int (*deliver)(void *, int, const void *, size_t), void *ctx)
{
    if (on_ucx_async_thread())
        return 0;
    l->deliver = deliver;
    l->deliver_ctx = ctx;
    int n = (int)progress(l);
    l->deliver = NULL;
    l->deliver_ctx = NULL;
    return n;
}

/* Events waiting to be taken with bpx_next_event. */
size_t bpx_queued(bpx_link *l)
{
    return l->qlen;
}

/* Arms the wake-up fd: 1 if it is safe to sleep on it, 0 if there is more to progress first. */
int bpx_arm(bpx_link *l)
{
    return ucp_worker_arm(l->worker) == UCS_OK;
}

/* Takes the oldest event; 1 if there was one. The caller frees ev->data with bpx_free. */
int bpx_next_event(bpx_link *l, bpx_event *ev)
{
    if (!l->qlen)
        return 0;
    *ev = l->q[l->qhead];
    l->qhead = (l->qhead + 1) % l->qcap;
    l->qlen--;
    return 1;
}

void bpx_free(void *p)
{
    buf_free(p);
}

/* Closes an endpoint at once (outstanding sends are cancelled). */
void bpx_close(bpx_link *l, int index)
{
    if (index < 0 || index >= BPX_MAX_EPS || !l->eps[index].ep)
        return;
    ucp_request_param_t p;
    memset(&p, 0, sizeof p);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(l->eps[index].ep, &p);
    l->eps[index].ep = NULL;
    l->eps[index].closing = 1;
    if (UCS_PTR_IS_PTR(r)) {
        while (ucp_request_check_status(r) == UCS_INPROGRESS)
            progress(l);
        ucp_request_free(r);
    }
    l->eps[index].closing = 0;
    unsettle(&l->eps[index]);
    /* Events already queued for this index are stale now: drop them. */
    for (size_t i = 0; i < l->qlen; i++) {
        bpx_event *e = &l->q[(l->qhead + i) % l->qcap];
        if (e->ep == index)
            e->ep = -1;
    }
}

/* Closes an endpoint once what was sent on it has left, telling the peer after the data (a
 * forced close can reach the peer before the last bytes, which it then never reads); at most
 * timeout_us. 1 if it closed in time. One that did not stays half closed inside UCX, and
 * ucp_worker_destroy aborts on an assertion over such an endpoint (UCX 1.13, seen under
 * load): the link is marked so that its worker is then left to the process's end. */
int bpx_close_flush(bpx_link *l, int index, long timeout_us)
{
    if (index < 0 || index >= BPX_MAX_EPS || !l->eps[index].ep)
        return 0;
    ucp_request_param_t p;
    memset(&p, 0, sizeof p);
    ucs_status_ptr_t r = ucp_ep_close_nbx(l->eps[index].ep, &p);
    l->eps[index].ep = NULL;
    l->eps[index].closing = 1;
    int ok = !UCS_PTR_IS_ERR(r), pending = 0;
    if (UCS_PTR_IS_PTR(r)) {
        struct timespec t0, t;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        ucs_status_t s;
        while ((s = ucp_request_check_status(r)) == UCS_INPROGRESS) {
            progress(l);
            clock_gettime(CLOCK_MONOTONIC, &t);
            long us = (t.tv_sec - t0.tv_sec) * 1000000L + (t.tv_nsec - t0.tv_nsec) / 1000;
            if (us > timeout_us)
                break;
        }
        if (s == UCS_INPROGRESS) {
            l->half_closed = 1; /* the request stays UCX's */
            ok = 0;
            pending = 1;
        } else {
            ok = s == UCS_OK;
            ucp_request_free(r);
        }
    }
    /* A half-closed endpoint keeps its slot: UCX may still report on it, by this index. */
    if (!pending)
        l->eps[index].closing = 0;
    unsettle(&l->eps[index]);
    for (size_t i = 0; i < l->qlen; i++) {
        bpx_event *e = &l->q[(l->qhead + i) % l->qcap];
        if (e->ep == index)
            e->ep = -1;
    }
    return ok;
}

/* UCP's own description of an endpoint (its lanes: transport/device per lane), into buf. */
size_t bpx_ep_info(bpx_link *l, int index, char *buf, size_t cap)
{
    if (index < 0 || index >= BPX_MAX_EPS || !l->eps[index].ep || !cap)
        return 0;
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f)
        return 0;
    ucp_ep_print_info(l->eps[index].ep, f);
    fclose(f);
    size_t n = len < cap - 1 ? len : cap - 1;
    memcpy(buf, text, n);
    buf[n] = 0;
    free(text);
    return n;
}

/* Closes every endpoint (at once) and drops every queued event: the link as freshly opened,
 * listener and all, for another user. */
void bpx_reset(bpx_link *l)
{
    for (int i = 0; i < BPX_MAX_EPS; i++)
        bpx_close(l, i);
    while (progress(l))
        ;
    for (size_t i = 0; i < l->qlen; i++)
        buf_free(l->q[(l->qhead + i) % l->qcap].data);
    l->qhead = 0;
    l->qlen = 0;
}

void bpx_close_all(bpx_link *l)
{
    for (int i = 0; i < BPX_MAX_EPS; i++)
        bpx_close(l, i);
    if (l->listener)
        ucp_listener_destroy(l->listener);
    /* (A half-closed endpoint makes ucp_worker_destroy abort: see bpx_close_flush.) */
    if (l->worker && !l->half_closed)
        ucp_worker_destroy(l->worker);
    if (l->ctx && !l->half_closed)
        ucp_cleanup(l->ctx);
    for (size_t i = 0; i < l->qlen; i++)
        buf_free(l->q[(l->qhead + i) % l->qcap].data);
    buf_free(l->spare);
    free(l->q);
    free(l);
}
