"""Compiled socket calls of the TCP backend: a connection's sends, receives and round trips outside the GIL.

This is the fast path of ``sockets.Channel`` (the plain-Python reference): the same bytes in the
same order, the same spin-then-block waits, the same bounds. A ``FastChannel`` wraps the descriptor
of a connected socket that stays owned (and closed) by its Python ``socket`` object. Every call:

- takes Python buffers (``bytes``, ``bytearray``, ``memoryview`` of a registered region) with the
  GIL held, then moves bytes with ``sendmsg``/``recvmsg`` on those buffers (scatter/gather, nothing
  copied) with the GIL released, then releases the buffers;
- never blocks in a socket call: every call is ``MSG_DONTWAIT``; a receive that would block first
  polls for up to ``spin_us`` (the adaptive back-off of ``Channel``: after two fruitless spins in a
  row, 16 waits without a spin, doubling up to 1024; a spin that pays resets it; past its first
  try a spin polls readiness (``ppoll`` with no timeout), which, unlike a receive, does not take the
  socket's lock that the sender's delivery into it needs; a spin during which
  the thread was preempted counts as fruitless, so a peer on the same CPU is recognised), then waits in
  ``ppoll`` bounded by ``progress_s`` (or ``first_wait_s`` for a first byte) and by the deadline;
- returns a code, never raises for a socket outcome: ``OK``; ``TIMEOUT`` (no progress within the
  wait); ``DEADLINE`` (the deadline, ``time.monotonic()`` seconds, passed); ``CLOSED`` (the peer
  closed; ``got`` bytes of the frame had come); ``OSERROR`` (``errno`` says which); ``MISMATCH``
  (``round_trip`` only: the answer's header is not the expected OK answer; it lies in ``resp``,
  ``got`` body bytes landed in the body buffer, and the caller decides with the Python checks).
  The caller turns codes into the exceptions ``Channel`` raises. ``phase`` says whether the last call
  was sending (0) or receiving (1) when it ended.

The deadlines use ``CLOCK_MONOTONIC``, the clock of ``time.monotonic()`` on Linux. The nogil
helpers take only a pointer to the C state (``IoState``) and plain C values, never Python objects.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
cdef extern from "<errno.h>" nogil:
    int errno
    int EAGAIN
    int EINTR
    int EWOULDBLOCK
from libc.stdint cimport uint8_t, uint16_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len

cdef extern from "<sys/socket.h>" nogil:
    struct msghdr:
        void* msg_name
        unsigned int msg_namelen
        iovec* msg_iov
        size_t msg_iovlen
        void* msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t sendmsg(int fd, const msghdr* msg, int flags)
    int setsockopt(int fd, int level, int name, const void* value, unsigned int length)
    int SOL_SOCKET
    int SO_RCVTIMEO
    int SO_SNDTIMEO
    ssize_t recvmsg(int fd, msghdr* msg, int flags)
    int MSG_DONTWAIT
    int MSG_NOSIGNAL

cdef extern from "<sys/time.h>" nogil:
    struct timeval:
        long tv_sec
        long tv_usec

cdef extern from "<time.h>" nogil:
    struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(int clk, timespec* ts)
    int CLOCK_MONOTONIC

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int ppoll(pollfd* fds, unsigned long nfds, const timespec* timeout, const void* sigmask)
    short POLLIN
    short POLLOUT

OK, TIMEOUT, DEADLINE, CLOSED, OSERROR, MISMATCH = 0, 1, 2, 3, 4, 5
cdef enum:
    C_OK = 0
    C_TIMEOUT = 1
    C_DEADLINE = 2
    C_CLOSED = 3
    C_OSERROR = 4
    C_MISMATCH = 5
    BACKOFF_MIN = 16
    BACKOFF_MAX = 1024
    RESPONSE_BYTES = 64  # protocol.RESPONSE.size (version 2); sockets.py refuses a build where they differ
    RESPONSE_FIELD_BYTES = 24  # magic, version, status, reserved, request id, length; then zero padding
    C_PROTOCOL_VERSION = 2  # protocol.PROTOCOL_VERSION; sockets.py refuses a build where they differ

RESPONSE_HEADER_BYTES = RESPONSE_BYTES  # for those checks
PROTOCOL_VERSION = C_PROTOCOL_VERSION
# the padding of a canonical response header (bytes 24..63): zero (C zero-initialises a static array)
cdef uint8_t ZERO_PADDING[RESPONSE_BYTES - RESPONSE_FIELD_BYTES]

# Two polls of a spin further apart than this mean the thread was preempted in between (one poll
# takes about a microsecond): the peer probably runs on this CPU, where spinning only delays it.
cdef double PREEMPTED_S = 10e-6

cdef struct IoState:
    int fd
    double spin_s
    double progress_s
    int skip        # waits left that do not spin
    int fails       # fruitless spins in a row
    int backoff     # the next back-off
    int noblock     # the descriptor turned out non-blocking: every wait polls
    double armed    # the kernel timeout (SO_RCVTIMEO/SO_SNDTIMEO, s) set on the socket; -1: unknown
    int err         # errno of the last OSERROR
    size_t got      # bytes of the current frame received when the call ended
    uint64_t spins, paid, preempted, blocked  # counters: spins begun, spins that paid, spins preempted, blocking waits


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9


cdef inline void _consume(iovec* iov, int* first, int n, size_t k) noexcept nogil:
    """Advance the vector ``iov[first[0]:n]`` past ``k`` bytes."""
    cdef int i = first[0]
    while k and i < n:
        if k >= iov[i].iov_len:
            k -= iov[i].iov_len
            iov[i].iov_len = 0
            i += 1
        else:
            iov[i].iov_base = <void*>(<char*>iov[i].iov_base + k)
            iov[i].iov_len -= k
            k = 0
    while i < n and iov[i].iov_len == 0:
        i += 1
    first[0] = i


cdef int _arm(IoState* st) noexcept nogil:
    """Make the kernel timeouts of both directions ``progress_s`` (a blocking call then waits at most that)."""
    cdef timeval tv
    if st.armed == st.progress_s:
        return 0
    tv.tv_sec = <long>st.progress_s
    tv.tv_usec = <long>((st.progress_s - <double>tv.tv_sec) * 1e6)
    if tv.tv_sec == 0 and tv.tv_usec == 0:
        tv.tv_usec = 1
    if (setsockopt(st.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0
            or setsockopt(st.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) != 0):
        st.armed = -1.0
        return -1
    st.armed = st.progress_s
    return 0


cdef inline int _ended(double now, double deadline) noexcept nogil:
    return C_DEADLINE if now >= deadline else C_TIMEOUT


cdef int _wait_io(IoState* st, msghdr* m, ssize_t* out, int sending, double wait_s, double deadline) noexcept nogil:
    """One wait for progress of at most ``wait_s`` (never past ``deadline``), then one transfer on ``m``
    (``out``: its byte count, 0 for a closed peer). It blocks in the socket call itself when the kernel
    timeout (``progress_s``) fits in what is left of both bounds (one system call per wait), else in
    ``ppoll`` for exactly what is left, then calls without blocking."""
    cdef pollfd p
    cdef timespec ts
    cdef double t, now, t0, bound
    cdef ssize_t k
    cdef int r
    t0 = _now()
    now = t0
    bound = t0 + wait_s
    if deadline < bound:
        bound = deadline
    while True:
        if not st.noblock and now + st.progress_s <= bound + 1e-3 and _arm(st) == 0:
            if sending:
                k = sendmsg(st.fd, m, MSG_NOSIGNAL)
            else:
                k = recvmsg(st.fd, m, 0)
            if k >= 0:
                out[0] = k
                return C_OK
            if errno != EINTR and errno != EAGAIN and errno != EWOULDBLOCK:
                st.err = errno
                return C_OSERROR
            t = _now()
            if errno != EINTR and t - now < 0.5 * st.progress_s:
                st.noblock = 1  # the descriptor does not block (someone made it non-blocking): poll from now on
            now = t
            continue
        t = bound - now
        if t <= 0:
            return _ended(now, deadline)
        ts.tv_sec = <long>t
        ts.tv_nsec = <long>((t - <double>ts.tv_sec) * 1e9)
        p.fd = st.fd
        p.events = POLLOUT if sending else POLLIN
        p.revents = 0
        r = ppoll(&p, 1, &ts, NULL)
        if r < 0 and errno != EINTR:
            st.err = errno
            return C_OSERROR
        if r > 0:
            if sending:
                k = sendmsg(st.fd, m, MSG_DONTWAIT | MSG_NOSIGNAL)
            else:
                k = recvmsg(st.fd, m, MSG_DONTWAIT)
            if k >= 0:
                out[0] = k
                return C_OK
            if errno != EINTR and errno != EAGAIN and errno != EWOULDBLOCK:
                st.err = errno
                return C_OSERROR
        now = _now()


cdef int _send(IoState* st, iovec* iov, int n, double deadline) noexcept nogil:
    """Send every byte of ``iov[0:n]``."""
    cdef msghdr m
    cdef int first = 0
    cdef ssize_t k
    cdef int rc
    memset(&m, 0, sizeof(m))
    _consume(iov, &first, n, 0)
    while first < n:
        m.msg_iov = iov + first
        m.msg_iovlen = n - first
        k = sendmsg(st.fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL)
        if k < 0:
            if errno == EINTR:
                continue
            if errno != EAGAIN and errno != EWOULDBLOCK:
                st.err = errno
                return C_OSERROR
            rc = _wait_io(st, &m, &k, 1, st.progress_s, deadline)
            if rc != C_OK:
                return rc
        _consume(iov, &first, n, <size_t>k)
    return C_OK


cdef inline void _fruitless(IoState* st) noexcept nogil:
    """A spin that did not pay: from the second in a row, skip the next ``backoff`` spins, doubling it."""
    st.fails += 1
    if st.fails >= 2:
        st.skip = st.backoff
        st.backoff = st.backoff * 2 if st.backoff * 2 < BACKOFF_MAX else BACKOFF_MAX


cdef int _recv(IoState* st, iovec* iov, int n, size_t stop, double first_wait_s, double deadline,
               int spin) noexcept nogil:
    """Receive into ``iov[0:n]`` until ``st.got`` reaches ``stop`` (at most the vector's length); a first
    byte may take ``first_wait_s`` when ``st.got`` is 0, later ones ``progress_s`` each. Each wait first
    spins (unless backing off), then blocks (``_wait_io``)."""
    cdef msghdr m
    cdef int first = 0
    cdef ssize_t k
    cdef int rc, e, spun
    cdef double spin_end, last, now
    cdef pollfd p
    cdef timespec zero
    zero.tv_sec = 0
    zero.tv_nsec = 0
    p.fd = st.fd
    p.events = POLLIN
    memset(&m, 0, sizeof(m))
    _consume(iov, &first, n, 0)
    while st.got < stop and first < n:
        m.msg_iov = iov + first
        m.msg_iovlen = n - first
        k = -1
        e = EAGAIN
        if spin and st.spin_s > 0:
            if st.skip:
                st.skip -= 1
            else:
                spun = 0
                st.spins += 1
                last = _now()
                spin_end = last + st.spin_s
                if spin_end > deadline:
                    spin_end = deadline
                while True:
                    now = _now()
                    if now - last > PREEMPTED_S:
                        st.preempted += 1
                        break  # preempted between two polls: the peer may share this CPU
                    if spun:  # past the first try, poll readiness: it does not take the socket's lock
                        p.revents = 0
                        if ppoll(&p, 1, &zero, NULL) <= 0:
                            last = _now()
                            if last - now > PREEMPTED_S:
                                st.preempted += 1
                                break
                            if last >= spin_end:
                                break
                            continue
                    k = recvmsg(st.fd, &m, MSG_DONTWAIT)
                    if k >= 0:
                        break
                    e = errno
                    if e != EAGAIN and e != EWOULDBLOCK and e != EINTR:
                        break
                    spun = 1
                    last = _now()
                    if last - now > PREEMPTED_S:
                        st.preempted += 1
                        break  # preempted in the poll
                    if last >= spin_end:
                        break  # the budget is spent
                if k > 0 and spun:
                    st.paid += 1
                    st.fails = 0  # the spin paid (data there at the first poll is no evidence either way)
                    st.backoff = BACKOFF_MIN
                elif k < 0 and (e == EAGAIN or e == EWOULDBLOCK or e == EINTR):
                    _fruitless(st)
        if k < 0:
            if e != EAGAIN and e != EWOULDBLOCK and e != EINTR:
                st.err = e
                return C_OSERROR
            st.blocked += 1
            rc = _wait_io(st, &m, &k, 0, first_wait_s if st.got == 0 else st.progress_s, deadline)
            if rc != C_OK:
                return rc
        if k == 0:
            return C_CLOSED
        st.got += <size_t>k
        _consume(iov, &first, n, <size_t>k)
    return C_OK


cdef class FastChannel:
    """The compiled calls on one connected socket's descriptor (see the module docstring)."""

    cdef IoState st
    cdef readonly object sock
    cdef readonly int phase

    def __cinit__(self, sock, double progress_s, int spin_us=0):
        self.sock = sock  # keeps the descriptor open as long as this object lives
        memset(&self.st, 0, sizeof(IoState))
        self.st.fd = sock.fileno()
        self.st.progress_s = progress_s
        self.st.spin_s = spin_us * 1e-6
        self.st.backoff = BACKOFF_MIN
        self.st.armed = -1.0

    @property
    def armed_s(self) -> float:
        """The kernel timeout this object believes is set on the socket (-1: unknown); ``Channel`` keeps it
        in step when it sets one itself."""
        return self.st.armed

    @armed_s.setter
    def armed_s(self, double seconds):
        self.st.armed = seconds

    @property
    def got(self) -> int:
        """Bytes of the frame (header and body) received when the last call ended."""
        return self.st.got

    def counters(self) -> dict:
        """Receive waits since this object was made: spins begun, spins that paid, spins cut short because
        the thread was preempted, and waits that blocked."""
        return {"spins": self.st.spins, "paid": self.st.paid, "preempted": self.st.preempted,
                "blocked": self.st.blocked}

    @property
    def errno(self) -> int:
        return self.st.err

    def send(self, head, body=None, double deadline=float("inf")) -> int:
        """Send ``head`` then ``body`` (``None``: none) in one gather call where the socket allows."""
        cdef Py_buffer hb, bb
        cdef iovec iov[2]
        cdef int n = 1, rc
        cdef IoState* st = &self.st
        self.phase = 0
        if _now() >= deadline:
            return C_DEADLINE
        PyObject_GetBuffer(head, &hb, PyBUF_SIMPLE)
        try:
            iov[0].iov_base = hb.buf
            iov[0].iov_len = <size_t>hb.len
            if body is not None:
                PyObject_GetBuffer(body, &bb, PyBUF_SIMPLE)
                iov[1].iov_base = bb.buf
                iov[1].iov_len = <size_t>bb.len
                n = 2
            try:
                with nogil:
                    rc = _send(st, iov, n, deadline)
            finally:
                if n == 2:
                    PyBuffer_Release(&bb)
        finally:
            PyBuffer_Release(&hb)
        return rc

    def recv_into(self, view, double deadline=float("inf"), double first_wait_s=-1.0, bint spin=True) -> int:
        """Fill ``view``; ``first_wait_s`` (if ≥ 0) bounds the wait for its first byte instead of ``progress_s``;
        ``spin=False``: every wait blocks at once."""
        cdef Py_buffer vb
        cdef iovec iov[1]
        cdef int rc
        cdef IoState* st = &self.st
        self.phase = 1
        st.got = 0
        if _now() >= deadline:
            return C_DEADLINE
        if first_wait_s < 0:
            first_wait_s = st.progress_s
        PyObject_GetBuffer(view, &vb, PyBUF_WRITABLE)
        try:
            iov[0].iov_base = vb.buf
            iov[0].iov_len = <size_t>vb.len
            with nogil:
                rc = _recv(st, iov, 1, <size_t>vb.len, first_wait_s, deadline, spin)
        finally:
            PyBuffer_Release(&vb)
        return rc

    def round_trip(self, head, payload, resp, body, uint64_t request_id, double deadline) -> int:
        """Send request ``head`` (+ a WRITE's ``payload``: ``None`` for none), then ``answer``."""
        cdef int rc = self.send(head, payload, deadline)
        if rc != C_OK:
            return rc
        return self.answer(resp, body, request_id, deadline)

    def answer(self, resp, body, uint64_t request_id, double deadline) -> int:
        """Receive an answer's header into ``resp`` (``RESPONSE_HEADER_BYTES``, 64) and, when it is the canonical
        OK answer to ``request_id`` (magic, ``PROTOCOL_VERSION``, zero reserved field and zero padding) with
        exactly ``len(body)`` bytes (0 when ``body`` is ``None``), the READ data straight into ``body``.
        ``MISMATCH``: any other header (``got`` counts header and body bytes received; the rest is left in
        the socket for the caller's checks, ``protocol.decode_response``, which name the fault)."""
        cdef Py_buffer rb, bb
        cdef iovec iov[2]
        cdef int n = 1, rc = C_OK, has_body = 0
        cdef size_t body_len = 0
        cdef uint64_t rid, rlen
        cdef uint16_t reserved
        cdef uint8_t* r
        cdef IoState* st = &self.st
        self.phase = 1
        st.got = 0
        if _now() >= deadline:
            return C_DEADLINE
        PyObject_GetBuffer(resp, &rb, PyBUF_WRITABLE)
        try:
            if rb.len != RESPONSE_BYTES:
                raise ValueError(f"resp must be {RESPONSE_BYTES} bytes, got {rb.len}")
            if body is not None:
                PyObject_GetBuffer(body, &bb, PyBUF_WRITABLE)
                has_body = 1
                body_len = <size_t>bb.len
            r = <uint8_t*>rb.buf
            with nogil:
                iov[0].iov_base = rb.buf
                iov[0].iov_len = RESPONSE_BYTES
                if has_body and body_len:
                    iov[1].iov_base = bb.buf
                    iov[1].iov_len = body_len
                    n = 2
                rc = _recv(st, iov, n, RESPONSE_BYTES, st.progress_s, deadline, 1)  # the header (+ what follows it)
                if rc == C_OK:
                    memcpy(&reserved, r + 6, 2)
                    memcpy(&rid, r + 8, 8)
                    memcpy(&rlen, r + 16, 8)
                    if (memcmp(r, b"QCTS", 4) != 0 or r[4] != C_PROTOCOL_VERSION or r[5] != 0 or reserved != 0
                            or rid != request_id or rlen != body_len
                            or memcmp(r + RESPONSE_FIELD_BYTES, ZERO_PADDING, RESPONSE_BYTES - RESPONSE_FIELD_BYTES)):
                        rc = C_MISMATCH
                    elif n == 2:  # _recv left the vector advanced past the bytes it filled: go on
                        rc = _recv(st, iov, n, RESPONSE_BYTES + body_len, st.progress_s, deadline, 1)
        finally:
            if has_body:
                PyBuffer_Release(&bb)
            PyBuffer_Release(&rb)
        return rc
