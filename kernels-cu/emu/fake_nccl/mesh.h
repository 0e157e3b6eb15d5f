// How the ranks of a fake NCCL communicator reach each other: a mesh of Unix-domain stream
// sockets, one per pair of ranks, whether the ranks are threads of one process or processes.
// Each connection has a thread that reads whatever the peer sends into inboxes, so a send never
// waits for the peer to receive (NCCL's grouped sends and receives may be posted in any order)
// and a wait for a message is a wait on a condition variable, with a deadline and a way out
// (abort).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "nccl_api.h"

namespace fake_nccl {

// A failure: NCCL's code and why. Converts to true when it is one.
struct Error {
    ncclResult_t code = ncclSuccess;
    std::string why;
    explicit operator bool() const { return code != ncclSuccess; }
};

Error fail(ncclResult_t code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// How long a wait on another rank may last before it fails with ncclSystemError, in seconds:
// FAKE_NCCL_TIMEOUT_S, 60 by default (NCCL itself waits forever).
double timeout_seconds();

// What the unique id holds: where the ranks meet, and a nonce that tells this communicator's
// ranks from any other's.
struct Rendezvous {
    std::uint64_t nonce = 0;
    std::string base;  // the listening sockets are `<base>.<rank>`
};

// A fresh rendezvous under $TMPDIR (or /tmp when that path is too long for a socket address),
// written into an ncclUniqueId.
void make_unique_id(ncclUniqueId& id);
// The rendezvous an id names; false when the id is not one of make_unique_id's.
bool read_unique_id(const ncclUniqueId& id, Rendezvous& out);

// Messages travel in lanes, each matched in order on its own: point-to-point data (ncclSend
// to ncclRecv, in the order both sides posted them), collectives (in call order), and the
// receivers' answers to sends (whether the receive matched).
enum Lane : std::uint32_t { kP2p = 0, kCollective = 1, kAck = 2, kLanes = 3 };
// Not a lane: the sender failed, and says why (its later messages never come).
constexpr std::uint32_t kFailed = 3;

struct Header {
    std::uint32_t magic;
    std::uint32_t lane;  // a Lane, or kFailed
    std::int32_t op;     // kCollective: which one; kAck: 1 when the receive did not match
    std::int32_t dtype;
    std::int32_t redop;
    std::int32_t root;
    std::uint64_t count;
    std::uint64_t seq;    // kCollective: the collective's number on its communicator
    std::uint64_t bytes;  // of payload after the header
};

struct Message {
    Header h{};
    std::vector<unsigned char> payload;
};

// One rank's connections to every rank of its communicator.
class Mesh {
public:
    // Joins the communicator `id` names as `rank` of `nranks` on CUDA device `device`: connects
    // to every lower rank, accepts every higher one, and learns every rank's device (two ranks
    // on one device are refused, as NCCL refuses them). Waits at most timeout_seconds() for the
    // others.
    static Error join(const Rendezvous& at, int nranks, int rank, int device, std::unique_ptr<Mesh>& out);

    ~Mesh();
    Mesh(const Mesh&) = delete;
    Mesh& operator=(const Mesh&) = delete;

    // Sends a message to `peer` (to this rank itself: straight into its inbox). Does not wait for
    // the peer to receive it. `what` names the operation in errors.
    Error post(int peer, const Header& h, const void* payload, const char* what);
    // The next message of `lane` from `peer`, waiting for it.
    Error take(int peer, Lane lane, Message& out, const char* what);
    // Tells every other rank that this one failed, and why (best effort: a peer that is gone
    // does not need to know).
    void tell_failed(const std::string& why);
    // Wakes every wait of this rank and closes its connections: its waits fail now, and the
    // other ranks' waits for it fail as soon as they need it.
    void abort();

private:
    struct Peer {
        int fd = -1;
        std::thread reader;
        std::deque<Message> inbox[kLanes];
        bool closed = false;  // nothing more will come (the peer left, failed or sent garbage)
        std::string why;      // why, when closed
        std::mutex writing;   // one message at a time on the socket
    };

    Mesh(int nranks, int rank) : rank_(rank), nranks_(nranks), devices_(nranks, -1), peers_(nranks) {}
    void read_loop(int peer);

    int rank_;
    int nranks_;
    std::vector<int> devices_;
    std::vector<std::unique_ptr<Peer>> peers_;  // one per rank, this rank's own included
    std::mutex mutex_;                          // the inboxes and the closed flags
    std::condition_variable arrived_;
    std::atomic<bool> aborted_{false};
};

}  // namespace fake_nccl
