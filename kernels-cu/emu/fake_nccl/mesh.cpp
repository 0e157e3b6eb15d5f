// The fake NCCL's sockets: the unique id, the rendezvous that forms a communicator's mesh, and
// the connections' readers (see mesh.h).
#include "mesh.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <utility>

namespace fake_nccl {

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint32_t kMessageMagic = 0x66634e4d;  // on every message header
constexpr char kIdMagic[8] = {'f', 'a', 'k', 'e', 'N', 'C', 'C', 'L'};

// The unique id's 128 bytes.
struct IdLayout {
    char magic[8];
    std::uint64_t nonce;
    char base[112];  // NUL-terminated
};
static_assert(sizeof(IdLayout) == NCCL_UNIQUE_ID_BYTES);

// What two ranks tell each other when they connect.
struct Hello {
    std::uint64_t nonce;
    std::int32_t rank;
    std::int32_t nranks;
    std::int32_t device;
    std::int32_t pid;
};

Clock::time_point deadline_from_now() {
    return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_seconds()));
}

// What is left until `deadline`, as a socket timeout (at least a millisecond: 0 means none).
timeval remaining(Clock::time_point deadline) {
    const auto left = std::max<Clock::duration>(deadline - Clock::now(), std::chrono::milliseconds(1));
    const auto us = std::chrono::duration_cast<std::chrono::microseconds>(left).count();
    return timeval{(time_t)(us / 1000000), (suseconds_t)(us % 1000000)};
}

void set_timeout(int fd, int option, const timeval& tv) { setsockopt(fd, SOL_SOCKET, option, &tv, sizeof tv); }

// Writes all of `data`; errno says why not. Never raises SIGPIPE (a peer that left is an error
// to report, not a reason to die).
bool send_all(int fd, const void* data, std::size_t n) {
    const auto* p = (const unsigned char*)data;
    while (n > 0) {
        const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return false;
        p += k;
        n -= (std::size_t)k;
    }
    return true;
}

// Reads exactly `n` bytes; false at the end of the stream (errno 0) or on an error.
bool recv_all(int fd, void* data, std::size_t n) {
    auto* p = (unsigned char*)data;
    while (n > 0) {
        const ssize_t k = ::recv(fd, p, n, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k == 0) errno = 0;
        if (k <= 0) return false;
        p += k;
        n -= (std::size_t)k;
    }
    return true;
}

bool address(const std::string& path, sockaddr_un& out) {
    std::memset(&out, 0, sizeof out);
    out.sun_family = AF_UNIX;
    if (path.size() >= sizeof out.sun_path) return false;
    std::memcpy(out.sun_path, path.c_str(), path.size() + 1);
    return true;
}

std::string socket_path(const Rendezvous& at, int rank) { return at.base + "." + std::to_string(rank); }

// Closes a descriptor when it goes out of scope, unless released.
struct Fd {
    int fd = -1;
    explicit Fd(int f) : fd(f) {}
    ~Fd() {
        if (fd >= 0) ::close(fd);
    }
    int release() { return std::exchange(fd, -1); }
};

// Connects to `path`, retrying while nobody listens there yet, until `deadline`.
int connect_by(const std::string& path, Clock::time_point deadline) {
    sockaddr_un addr;
    if (!address(path, addr)) return -1;
    for (;;) {
        const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) return -1;
        if (::connect(fd, (const sockaddr*)&addr, sizeof addr) == 0) return fd;
        const int err = errno;
        ::close(fd);
        if ((err != ENOENT && err != ECONNREFUSED && err != EAGAIN) || Clock::now() >= deadline) return -1;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
}

}  // namespace

Error fail(ncclResult_t code, const char* fmt, ...) {
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    return Error{code, text};
}

double timeout_seconds() {
    if (const char* v = std::getenv("FAKE_NCCL_TIMEOUT_S")) {
        char* end = nullptr;
        const double s = std::strtod(v, &end);
        if (end != v && *end == '\0' && s > 0) return s;
    }
    return 60;
}

void make_unique_id(ncclUniqueId& id) {
    IdLayout layout{};
    std::memcpy(layout.magic, kIdMagic, sizeof kIdMagic);
    std::random_device random;
    layout.nonce = ((std::uint64_t)random() << 32) ^ random();
    char name[64];
    std::snprintf(name, sizeof name, "fake-nccl-%d-%016llx", (int)getpid(), (unsigned long long)layout.nonce);
    // A socket address holds 107 bytes of path; `.<rank>` follows the base.
    std::string dir = std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "";
    // The id must name an absolute path (read_unique_id refuses others): a relative $TMPDIR
    // would mean another place in a process with another working directory.
    if (dir.empty() || dir[0] != '/' || dir.size() + 1 + std::strlen(name) + 8 >= sizeof(sockaddr_un{}.sun_path)) {
        dir = "/tmp";
    }
    if (dir.back() != '/') dir += '/';
    std::snprintf(layout.base, sizeof layout.base, "%s%s", dir.c_str(), name);
    std::memcpy(id.internal, &layout, sizeof layout);
}

bool read_unique_id(const ncclUniqueId& id, Rendezvous& out) {
    IdLayout layout;
    std::memcpy(&layout, id.internal, sizeof layout);
    if (std::memcmp(layout.magic, kIdMagic, sizeof kIdMagic) != 0) return false;
    if (std::memchr(layout.base, '\0', sizeof layout.base) == nullptr || layout.base[0] != '/') return false;
    out.nonce = layout.nonce;
    out.base = layout.base;
    return true;
}

Error Mesh::join(const Rendezvous& at, int nranks, int rank, int device, std::unique_ptr<Mesh>& out) {
    std::unique_ptr<Mesh> mesh(new Mesh(nranks, rank));
    for (auto& p : mesh->peers_) p = std::make_unique<Peer>();
    mesh->devices_[rank] = device;
    const Clock::time_point deadline = deadline_from_now();
    const Hello mine{at.nonce, rank, nranks, device, (std::int32_t)getpid()};
    const auto waited = [&](const char* doing, int peer) {
        return fail(ncclSystemError, "rank %d gave up after %g s %s rank %d (FAKE_NCCL_TIMEOUT_S): did it call "
                    "ncclCommInitRank with this unique id and %d ranks?", rank, timeout_seconds(), doing, peer, nranks);
    };
    const auto other_world = [&](const Hello& theirs) {
        return fail(ncclInvalidUsage, "rank %d joined a communicator of %d ranks, rank %d one of %d (the same unique id)",
                    rank, nranks, theirs.rank, theirs.nranks);
    };

    // The listener the higher ranks connect to; its socket file goes once they all have.
    const std::string path = socket_path(at, rank);
    Fd listener(-1);
    struct Unlink {
        const std::string* path = nullptr;
        ~Unlink() {
            if (path) ::unlink(path->c_str());
        }
    } unlink_listener;
    if (rank + 1 < nranks) {
        sockaddr_un addr;
        if (!address(path, addr)) return fail(ncclSystemError, "socket path %s is too long", path.c_str());
        listener.fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (listener.fd < 0) return fail(ncclSystemError, "socket: %s", std::strerror(errno));
        if (::bind(listener.fd, (const sockaddr*)&addr, sizeof addr) != 0) {
            if (errno == EADDRINUSE) {
                return fail(ncclInvalidUsage, "rank %d of this unique id joined twice (%s exists)", rank, path.c_str());
            }
            return fail(ncclSystemError, "binding %s: %s", path.c_str(), std::strerror(errno));
        }
        unlink_listener.path = &path;
        if (::listen(listener.fd, nranks) != 0) return fail(ncclSystemError, "listen: %s", std::strerror(errno));
    }

    // The lower ranks, in order (each accepts once it has connected to the ones below it).
    for (int p = 0; p < rank; ++p) {
        Fd fd(connect_by(socket_path(at, p), deadline));
        if (fd.fd < 0) {
            if (Clock::now() >= deadline) return waited("waiting for", p);
            return fail(ncclSystemError, "rank %d connecting to rank %d at %s: %s", rank, p,
                        socket_path(at, p).c_str(), std::strerror(errno));
        }
        set_timeout(fd.fd, SO_RCVTIMEO, remaining(deadline));
        set_timeout(fd.fd, SO_SNDTIMEO, remaining(deadline));
        Hello theirs;
        if (!send_all(fd.fd, &mine, sizeof mine) || !recv_all(fd.fd, &theirs, sizeof theirs)) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return waited("waiting for an answer from", p);
            return fail(ncclRemoteError, "rank %d lost rank %d while joining: %s", rank, p,
                        errno ? std::strerror(errno) : "it closed the connection");
        }
        if (theirs.nonce != at.nonce || theirs.rank != p) {
            return fail(ncclInternalError, "rank %d reached %s, which is not rank %d of this communicator", rank,
                        socket_path(at, p).c_str(), p);
        }
        if (theirs.nranks != nranks) return other_world(theirs);
        mesh->devices_[p] = theirs.device;
        mesh->peers_[p]->fd = fd.release();
    }

    // The higher ranks, in any order.
    for (int accepted = 0; accepted < nranks - 1 - rank;) {
        pollfd pfd{listener.fd, POLLIN, 0};
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
        if (left <= 0 || ::poll(&pfd, 1, (int)std::min<long long>(left, 1000)) < 0) {
            if (left > 0 && errno == EINTR) continue;
            int missing = rank + 1;
            while (missing < nranks && mesh->peers_[missing]->fd >= 0) ++missing;
            return waited("waiting for", missing);
        }
        if (!(pfd.revents & POLLIN)) continue;
        Fd fd(::accept4(listener.fd, nullptr, nullptr, SOCK_CLOEXEC));
        if (fd.fd < 0) continue;
        set_timeout(fd.fd, SO_RCVTIMEO, remaining(deadline));
        set_timeout(fd.fd, SO_SNDTIMEO, remaining(deadline));
        Hello theirs;
        // Something else than a rank of this communicator: not ours to answer.
        if (!recv_all(fd.fd, &theirs, sizeof theirs) || theirs.nonce != at.nonce) continue;
        if (theirs.rank <= rank || theirs.rank >= nranks || mesh->peers_[theirs.rank]->fd >= 0) {
            if (theirs.nranks != nranks) return other_world(theirs);
            return fail(ncclInvalidUsage, "rank %d of this unique id joined twice, or rank %d is out of range", theirs.rank,
                        theirs.rank);
        }
        // Answer first, so that the other side sees a mismatch of sizes too.
        if (!send_all(fd.fd, &mine, sizeof mine)) {
            return fail(ncclRemoteError, "rank %d lost rank %d while joining: %s", rank, theirs.rank,
                        std::strerror(errno));
        }
        if (theirs.nranks != nranks) return other_world(theirs);
        mesh->devices_[theirs.rank] = theirs.device;
        mesh->peers_[theirs.rank]->fd = fd.release();
        ++accepted;
    }

    // Every rank knows every rank's device now, so every rank refuses a duplicate alike.
    for (int a = 0; a < nranks; ++a) {
        for (int b = a + 1; b < nranks; ++b) {
            if (mesh->devices_[a] == mesh->devices_[b]) {
                return fail(ncclInvalidUsage,
                            "Duplicate GPU detected: rank %d and rank %d both on cuda:%d (one rank per device)", a, b,
                            mesh->devices_[a]);
            }
        }
    }

    // Reads wait for the peer as long as it lives; a write waits at most the timeout for room.
    const double t = timeout_seconds();
    const timeval send_timeout{(time_t)t, (suseconds_t)((t - (double)(time_t)t) * 1e6)};
    for (int p = 0; p < nranks; ++p) {
        if (p == rank) continue;
        set_timeout(mesh->peers_[p]->fd, SO_RCVTIMEO, timeval{0, 0});
        set_timeout(mesh->peers_[p]->fd, SO_SNDTIMEO, send_timeout);
        mesh->peers_[p]->reader = std::thread([m = mesh.get(), p] { m->read_loop(p); });
    }
    out = std::move(mesh);
    return {};
}

void Mesh::read_loop(int p) {
    Peer& peer = *peers_[p];
    std::string why;
    for (;;) {
        Message msg;
        if (!recv_all(peer.fd, &msg.h, sizeof msg.h)) {
            why = errno == 0 || errno == ECONNRESET
                      ? "it closed its connection (its communicator was destroyed or aborted, or its process ended)"
                      : std::string("reading from it failed: ") + std::strerror(errno);
            break;
        }
        if (msg.h.magic != kMessageMagic || msg.h.lane > kFailed) {
            why = "it sent something that is not a message of this fake";
            break;
        }
        msg.payload.resize(msg.h.bytes);
        if (!recv_all(peer.fd, msg.payload.data(), msg.payload.size())) {
            why = "it closed its connection in the middle of a message";
            break;
        }
        std::lock_guard<std::mutex> lock(mutex_);
        if (peer.closed) continue;  // it failed: what follows is not to be used
        if (msg.h.lane == kFailed) {
            peer.closed = true;
            peer.why = "it failed: " + std::string(msg.payload.begin(), msg.payload.end());
        } else {
            peer.inbox[msg.h.lane].push_back(std::move(msg));
        }
        arrived_.notify_all();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (!peer.closed) {
        peer.closed = true;
        peer.why = why;
    }
    arrived_.notify_all();
}

Error Mesh::post(int p, const Header& header, const void* payload, const char* what) {
    Header h = header;
    h.magic = kMessageMagic;
    if (p == rank_) {
        Message msg{h, std::vector<unsigned char>((const unsigned char*)payload,
                                                  (const unsigned char*)payload + h.bytes)};
        std::lock_guard<std::mutex> lock(mutex_);
        peers_[p]->inbox[h.lane].push_back(std::move(msg));
        arrived_.notify_all();
        return {};
    }
    if (aborted_) return fail(ncclInvalidUsage, "rank %d's communicator was aborted (in %s)", rank_, what);
    Peer& peer = *peers_[p];
    std::lock_guard<std::mutex> lock(peer.writing);
    if (send_all(peer.fd, &h, sizeof h) && send_all(peer.fd, payload, h.bytes)) return {};
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return fail(ncclSystemError, "rank %d gave up after %g s sending to rank %d in %s (FAKE_NCCL_TIMEOUT_S): it "
                    "does not read", rank_, timeout_seconds(), p, what);
    }
    if (aborted_) return fail(ncclInvalidUsage, "rank %d's communicator was aborted (in %s)", rank_, what);
    return fail(ncclRemoteError, "rank %d could not send to rank %d in %s: it has left (%s)", rank_, p, what,
                std::strerror(errno));
}

Error Mesh::take(int p, Lane lane, Message& out, const char* what) {
    Peer& peer = *peers_[p];
    const Clock::time_point deadline = deadline_from_now();
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
        if (aborted_) {
            return fail(ncclInvalidUsage, "rank %d's communicator was aborted while it waited for rank %d in %s", rank_,
                        p, what);
        }
        // What arrived before the peer left or failed is still its message.
        if (!peer.inbox[lane].empty()) {
            out = std::move(peer.inbox[lane].front());
            peer.inbox[lane].pop_front();
            return {};
        }
        if (peer.closed) {
            return fail(ncclRemoteError, "rank %d waited for rank %d in %s, but %s", rank_, p, what, peer.why.c_str());
        }
        if (arrived_.wait_until(lock, deadline) == std::cv_status::timeout && peer.inbox[lane].empty() &&
            !peer.closed && !aborted_) {
            return fail(ncclSystemError,
                        "rank %d gave up after %g s waiting for rank %d in %s (FAKE_NCCL_TIMEOUT_S): did every rank "
                        "make the same calls?",
                        rank_, timeout_seconds(), p, what);
        }
    }
}

void Mesh::tell_failed(const std::string& why) {
    Header h{};
    h.lane = kFailed;
    h.bytes = why.size();
    for (int p = 0; p < nranks_; ++p) {
        if (p != rank_) post(p, h, why.data(), "telling it this rank failed");
    }
}

void Mesh::abort() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        aborted_ = true;
        arrived_.notify_all();
    }
    // The readers see the end of their streams; a blocked write fails; the peers see this rank
    // leave.
    for (auto& peer : peers_) {
        if (peer->fd >= 0) ::shutdown(peer->fd, SHUT_RDWR);
    }
}

Mesh::~Mesh() {
    abort();
    for (auto& peer : peers_) {
        if (peer->reader.joinable()) peer->reader.join();
        if (peer->fd >= 0) ::close(peer->fd);
    }
}

}  // namespace fake_nccl
