#include "cpu/gloo_comm.h"

#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/address.h>
#include <gloo/transport/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

#include <netdb.h>
#include <signal.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <optional>
#include <stdexcept>
#include <thread>

#include "cpu/host_reduce.h"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

// Slot prefix for our ring reduce-scatter; Gloo's own prefixes are 0x01..0x08.
constexpr uint8_t kRingSlotPrefix = 0x40;

// Gloo's rendezvous talks to a gloo::rendezvous::Store; this one forwards to a strata KvStore.
// Gloo expects exceptions from a store, so errors become std::runtime_error here and are caught
// again (with their message) in CreateGlooCommunicator.
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(KvStore* store, std::string prefix, std::chrono::milliseconds timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    const Status st = store_->Set(prefix_ + "/" + key,
                                  {reinterpret_cast<const uint8_t*>(data.data()), data.size()});
    if (!st.ok()) throw std::runtime_error(st.ToString());
    set_keys_.push_back(prefix_ + "/" + key);
  }
  // Deletes the keys this rank published. Call only once every peer has read them.
  Status DeletePublished() {
    Status first;
    for (const auto& k : set_keys_) {
      Status st = store_->Delete(k);
      if (!st.ok() && first.ok()) first = std::move(st);
    }
    set_keys_.clear();
    return first;
  }
  std::vector<char> get(const std::string& key) override {
    auto r = store_->Get(prefix_ + "/" + key, timeout_);
    if (!r.ok()) throw std::runtime_error(r.status().ToString());
    return std::vector<char>(r->begin(), r->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    for (const auto& k : keys) {
      auto r = store_->Get(prefix_ + "/" + k, t);
      if (!r.ok()) throw std::runtime_error(r.status().ToString());
    }
  }

 private:
  KvStore* store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
  std::vector<std::string> set_keys_;
};

// A Gloo context over pairs that Split connected itself (gloo::Context keeps its transport
// context protected; rendezvous::Context would need a store, which is gone after Create).
class SplitContext final : public gloo::Context {
 public:
  SplitContext(int rank, int size, std::shared_ptr<gloo::transport::Device> device,
               std::chrono::milliseconds timeout)
      : gloo::Context(rank, size) {
    setTimeout(timeout);
    device_ = std::move(device);
    transportContext_ = device_->createContext(rank, size);
    transportContext_->setTimeout(timeout);
  }
  gloo::transport::Context& transport() { return *transportContext_; }
};

// What Split's task on the parent's worker hands back to the caller (shared: the caller may stop
// waiting before the task ends).
struct SplitOutcome {
  std::shared_ptr<gloo::Context> ctx;  // null when the new communicator has one rank
  int rank = 0;
  int size = 1;
};

// One slot of Split's address exchange: the length, then the pair address (Gloo's maximum size).
constexpr size_t kAddrSlot = 4 + gloo::transport::Address::kMaxByteSize;

class GlooWork final : public CommWork {
 public:
  explicit GlooWork(std::string name) : name_(std::move(name)), issued_(Clock::now()) {}
  Status WaitUntil(Clock::time_point deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, deadline, [&] { return done_; })) {
      const auto waited =
          std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - issued_).count();
      return Status::DeadlineExceeded(name_ + ": not finished by the wait deadline, " +
                                      std::to_string(waited) + " s after it was issued");
    }
    return status_;
  }
  bool Ready() override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  void Finish(Status st) {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = std::move(st);
    done_ = true;
    cv_.notify_all();
  }
  const std::string& name() const { return name_; }

 private:
  const std::string name_;
  const Clock::time_point issued_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
};

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(const GlooCommOptions& o, std::shared_ptr<gloo::Context> ctx,
                   std::string label = "")
      : Communicator(o.rank, o.world_size),
        opts_(o),
        label_(std::move(label)),
        ctx_(std::move(ctx)),
        acc_(o.scratch_elems),
        tmp_(o.scratch_elems) {
    worker_ = std::thread([this] { WorkerLoop(); });
  }

  ~GlooCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failed_.ok()) failed_ = Status::Aborted("communicator destroyed");
      stop_ = true;
    }
    cv_.notify_all();
    space_cv_.notify_all();
    worker_.join();
  }

  std::string_view backend() const noexcept override { return "gloo"; }

  void Abort(std::string_view reason) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failed_.ok()) failed_ = Status::Aborted("communicator aborted: " + std::string(reason));
    }
    space_cv_.notify_all();  // a submitter waiting for queue space gives up now
  }

 protected:
  Result<CommHandle> DoAllGather(std::span<const AllGatherPart> parts, DType dtype) override {
    std::vector<AllGatherPart> ps(parts.begin(), parts.end());
    return Submit("all_gather", [this, ps, dtype] {
      for (const auto& p : ps) RunAllGather(p, DTypeSize(dtype));
      return Status::OK();
    });
  }

  Result<CommHandle> DoReduceScatter(std::span<const ReduceScatterPart> parts, DType dtype,
                                     ReduceOptions o) override {
    std::vector<ReduceScatterPart> ps(parts.begin(), parts.end());
    return Submit("reduce_scatter", [this, ps, dtype, o] {
      for (const auto& p : ps) RunReduceScatter(p, dtype, Scale(o));
      return Status::OK();
    });
  }

  Result<CommHandle> DoAllReduce(const void* send, void* recv, size_t count, DType dtype,
                                 ReduceOptions o) override {
    return Submit("all_reduce", [this, send, recv, count, dtype, o] {
      RunAllReduce(send, recv, count, dtype, Scale(o));
      return Status::OK();
    });
  }

  Result<CommHandle> DoBroadcast(void* buf, size_t count, DType dtype, int root) override {
    return Submit("broadcast", [this, buf, count, dtype, root] {
      const size_t bytes = count * DTypeSize(dtype);
      if (bytes == 0 || world_size() == 1) return Status::OK();
      gloo::BroadcastOptions b(ctx_);
      b.setOutput(static_cast<uint8_t*>(buf), bytes);
      b.setRoot(root);
      b.setTag(NextTag('b', bytes * 64 + static_cast<uint64_t>(root)));
      b.setTimeout(opts_.timeout);
      gloo::broadcast(b);
      // Gloo's broadcast tree is not instrumented: count the ideal root-send / non-root-receive.
      AddWireBytes(CommOp::kBroadcast, rank() == root ? bytes : 0, rank() == root ? 0 : bytes);
      return Status::OK();
    });
  }

  Result<CommHandle> DoAllToAll(const void* send, void* recv, size_t count, DType dtype) override {
    return Submit("all_to_all", [this, send, recv, count, dtype] {
      const size_t chunk = count * DTypeSize(dtype), n = static_cast<size_t>(world_size());
      if (chunk == 0) return Status::OK();
      if (n == 1) {
        std::memcpy(recv, send, chunk);
        return Status::OK();
      }
      gloo::AlltoallOptions a(ctx_);
      // Gloo's all-to-all is bytewise: the element type only sets its unit.
      a.setInput(static_cast<uint8_t*>(const_cast<void*>(send)), chunk * n);
      a.setOutput(static_cast<uint8_t*>(recv), chunk * n);
      a.setTag(NextTag('t', chunk));
      a.setTimeout(opts_.timeout);
      gloo::alltoall(a);
      // One chunk to and from each peer, exactly (no relay): the ideal figures are the wire ones.
      AddWireBytes(CommOp::kAllToAll, chunk * (n - 1), chunk * (n - 1));
      return Status::OK();
    });
  }

  Result<std::unique_ptr<Communicator>> DoSplit(int color, int key) override {
    auto out = std::make_shared<SplitOutcome>();
    STRATA_ASSIGN_OR_RETURN(CommHandle h, Submit("split", [this, color, key, out] {
                              RunSplit(color, key, *out);
                              return Status::OK();
                            }));
    // The task is bounded by the transport timeout of each of its steps (two all-gathers and one
    // connect per peer); this wait only guards against a bug there.
    const auto limit = opts_.timeout * (4 + 2 * world_size());
    Status st = h.WaitFor(std::chrono::duration_cast<std::chrono::milliseconds>(limit));
    if (st.code() == Status::Code::kDeadlineExceeded) Abort("split did not finish");
    STRATA_RETURN_IF_ERROR(st);
    GlooCommOptions o = opts_;
    o.rank = out->rank;
    o.world_size = out->size;
    o.store = nullptr;
    auto comm = std::make_unique<GlooCommunicator>(
        o, std::move(out->ctx),
        (label_.empty() ? "" : label_ + ", ") + "split color " + std::to_string(color));
    // As at Create: the first operation proves every pair works; then start counting from zero.
    STRATA_ASSIGN_OR_RETURN(CommHandle b, comm->Barrier());
    STRATA_RETURN_IF_ERROR(b.WaitFor(opts_.timeout).WithContext("gloo split barrier"));
    comm->ResetStats();
    return std::unique_ptr<Communicator>(std::move(comm));
  }

  Result<CommHandle> DoBarrier() override {
    return Submit("barrier", [this] {
      if (world_size() == 1) return Status::OK();
      gloo::BarrierOptions b(ctx_);
      b.setTag(NextTag('z', 0));
      b.setTimeout(opts_.timeout);
      gloo::barrier(b);
      return Status::OK();
    });
  }

 private:
  struct Task {
    std::shared_ptr<GlooWork> work;
    std::function<Status()> fn;
  };

  float Scale(ReduceOptions o) const { return o.predivide ? 1.0f / world_size() : 1.0f; }

  Result<CommHandle> Submit(const char* kind, std::function<Status()> fn) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!failed_.ok()) {
      return Status::Aborted(std::string("gloo ") + kind +
                             ": communicator failed earlier: " + failed_.ToString());
    }
    const bool space = space_cv_.wait_until(lock, Clock::now() + opts_.timeout, [&] {
      return stop_ || !failed_.ok() || queue_.size() + running_ < opts_.queue_depth;
    });
    if (!failed_.ok() || stop_) {
      return Status::Aborted(std::string("gloo ") + kind +
                             ": communicator failed while waiting "
                             "for queue space: " +
                             (failed_.ok() ? "stopped" : failed_.ToString()));
    }
    if (!space) {
      return Status::ResourceExhausted(std::string("gloo ") + kind + ": " +
                                       std::to_string(opts_.queue_depth) +
                                       " operations still queued after the timeout");
    }
    auto work = std::make_shared<GlooWork>(
        "gloo " + std::string(kind) + " #" + std::to_string(seq_++) + " (rank " +
        std::to_string(rank()) + " of " + std::to_string(world_size()) +
        (label_.empty() ? "" : ", " + label_) + ")");
    queue_.push_back(Task{work, std::move(fn)});
    cv_.notify_all();
    return CommHandle(work);
  }

  // Lifecycle: runs queued tasks in order until stopped. A task that throws (Gloo reports a closed
  // connection or a timeout as gloo::IoException) fails its handle and the communicator; later
  // tasks then fail fast without touching the transport. On destruction the queue is failed, the
  // running task (bounded by the transport timeout) is waited for.
  void WorkerLoop() {
    while (true) {
      Task t;
      Status failed;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        t = std::move(queue_.front());
        queue_.pop_front();
        running_ = 1;
        failed = failed_;
      }
      Status st;
      if (!failed.ok()) {
        st = Status::Aborted(t.work->name() + " not run: " + failed.ToString());
      } else {
        try {
          st = t.fn();
        } catch (const std::exception& e) {
          const std::string what = e.what();
          const std::string msg = t.work->name() + " failed: " + what +
                                  " (a peer exited, hung past the timeout, or the network failed)";
          st = what.find("Timed out") != std::string::npos ? Status::DeadlineExceeded(msg)
                                                           : Status::Unavailable(msg);
        }
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!st.ok() && failed_.ok()) failed_ = st;
        running_ = 0;
      }
      t.work->Finish(std::move(st));
      space_cv_.notify_all();
    }
  }

  // Byte all-gather over this communicator's context for Split's exchanges (not counted in the
  // stats: setup traffic). `out` holds world_size slots of `bytes`; this rank's is filled.
  void ExchangeBytes(uint8_t* out, size_t bytes) {
    gloo::AllgatherOptions a(ctx_);
    a.setOutput(out, bytes * static_cast<size_t>(world_size()));
    a.setTag(NextTag('x', bytes));
    a.setTimeout(opts_.timeout);
    gloo::allgather(a);
  }

  // Split on the worker thread (so it is ordered with the collectives before it): all-gather
  // (color, key), order the members of this rank's color by (key, rank), create one transport
  // pair per member on this communicator's device, all-gather the pair addresses (rank q's slot p
  // holds the address of q's pair for p), then connect each pair to its peer's address for this
  // rank. Connecting runs in member order on every rank, as Gloo's connectFullMesh does.
  void RunSplit(int color, int key, SplitOutcome& out) {
    const int n = world_size(), me = rank();
    if (n == 1) return;  // out: rank 0 of 1
    std::vector<int32_t> ck(2 * static_cast<size_t>(n));
    ck[2 * me] = color;
    ck[2 * me + 1] = key;
    ExchangeBytes(reinterpret_cast<uint8_t*>(ck.data()), 2 * sizeof(int32_t));
    std::vector<int> members;
    for (int q = 0; q < n; ++q) {
      if (ck[2 * q] == color) members.push_back(q);
    }
    std::stable_sort(members.begin(), members.end(),
                     [&](int a, int b) { return ck[2 * a + 1] < ck[2 * b + 1]; });
    out.size = static_cast<int>(members.size());
    out.rank = static_cast<int>(std::find(members.begin(), members.end(), me) - members.begin());
    std::shared_ptr<SplitContext> sub;
    std::vector<uint8_t> addrs(static_cast<size_t>(n) * n * kAddrSlot, 0);
    uint8_t* mine = addrs.data() + static_cast<size_t>(me) * n * kAddrSlot;
    if (out.size > 1) {
      sub = std::make_shared<SplitContext>(out.rank, out.size, ctx_->getDevice(), opts_.timeout);
      for (int i = 0; i < out.size; ++i) {
        if (i == out.rank) continue;
        const std::vector<char> a = sub->transport().createPair(i)->address().bytes();
        if (a.size() > gloo::transport::Address::kMaxByteSize) {
          throw std::runtime_error("split: transport address of " + std::to_string(a.size()) +
                                   " bytes");
        }
        uint8_t* slot = mine + static_cast<size_t>(members[i]) * kAddrSlot;
        const uint32_t len = static_cast<uint32_t>(a.size());
        std::memcpy(slot, &len, 4);
        std::memcpy(slot + 4, a.data(), a.size());
      }
    }
    ExchangeBytes(addrs.data(), static_cast<size_t>(n) * kAddrSlot);
    if (!sub) return;
    for (int i = 0; i < out.size; ++i) {
      if (i == out.rank) continue;
      const uint8_t* slot = addrs.data() + (static_cast<size_t>(members[i]) * n + me) * kAddrSlot;
      uint32_t len = 0;
      std::memcpy(&len, slot, 4);
      if (len == 0 || len > gloo::transport::Address::kMaxByteSize) {
        throw std::runtime_error("split: rank " + std::to_string(members[i]) +
                                 " published no address for rank " + std::to_string(me) +
                                 " (the ranks disagree on the split)");
      }
      sub->transport().getPair(i)->connect(std::vector<char>(
          reinterpret_cast<const char*>(slot + 4), reinterpret_cast<const char*>(slot + 4) + len));
    }
    out.ctx = std::move(sub);
  }

  void RunAllGather(const AllGatherPart& p, size_t elt) {
    const size_t bytes = p.send_count * elt;
    auto* out = static_cast<uint8_t*>(p.recv);
    uint8_t* own = out + static_cast<size_t>(rank()) * bytes;
    if (bytes == 0) return;
    if (world_size() == 1) {
      if (own != p.send) std::memcpy(own, p.send, bytes);
      return;
    }
    gloo::AllgatherOptions a(ctx_);
    // No input means in place: Gloo then sends this rank's slot of the output.
    if (own != p.send) std::memcpy(own, p.send, bytes);
    a.setOutput(out, bytes * static_cast<size_t>(world_size()));
    a.setTag(NextTag('g', bytes));
    a.setTimeout(opts_.timeout);
    gloo::allgather(a);
    // Gloo's ring all-gather: N-1 steps, each sending one rank's slot and receiving another's.
    const uint64_t moved = static_cast<uint64_t>(world_size() - 1) * bytes;
    AddWireBytes(CommOp::kAllGather, moved, moved);
  }

  void RunReduceScatter(const ReduceScatterPart& p, DType dtype, float scale) {
    const size_t s = p.recv_count;
    RingReduceScatter(CommOp::kReduceScatter, static_cast<const uint8_t*>(p.send),
                      s * static_cast<size_t>(world_size()), s, dtype, scale,
                      static_cast<uint8_t*>(p.recv));
  }

  // Ring reduce-scatter of `count` elements cut into world_size chunks of `chunk` elements (the
  // last ones shorter or empty), one segment of at most scratch_elems elements per chunk at a
  // time. Step k sends acc (the partial sum of chunk r-k-1) to the right and receives the partial
  // sum of chunk r-k-2 from the left, then adds this rank's own contribution to it; after N-1
  // steps acc holds chunk r summed over all ranks in fp32, stored to `out` in dtype. Both ends of
  // a step agree on its length (same chunk, same segment), so empty transfers are skipped on both.
  // Every chunk is read before the segment of chunk r is written, so `out` may be in's chunk r.
  // The fp32 bytes of each step are counted as wire bytes of `op`.
  void RingReduceScatter(CommOp op, const uint8_t* in, size_t count, size_t chunk, DType dtype,
                         float scale, uint8_t* out) {
    const size_t elt = DTypeSize(dtype);
    const int n = world_size(), r = rank();
    if (n == 1 && scale == 1.0f) {
      // A sum of one term, unscaled (predivide is 1/1): the input itself. The widen-and-round
      // loop below would return the same values through two scalar passes.
      if (out != in) std::memmove(out, in, std::min(count, chunk) * elt);
      return;
    }
    const int right = (r + 1) % n, left = (r + n - 1) % n;
    const uint64_t shape = (static_cast<uint64_t>(count) << 24) ^ chunk ^ (elt << 60);
    auto seg_len = [&](int c, size_t off) -> size_t {
      const size_t begin = std::min(count, static_cast<size_t>(c) * chunk + off);
      const size_t end = std::min(count, static_cast<size_t>(c) * chunk + chunk);
      return std::min(opts_.scratch_elems, end > begin ? end - begin : 0);
    };
    auto at = [&](int c, size_t off) { return in + (static_cast<size_t>(c) * chunk + off) * elt; };
    for (size_t off = 0; off < chunk; off += opts_.scratch_elems) {
      int c = (r + n - 1) % n;
      size_t len = seg_len(c, off);
      LoadScaled(dtype, at(c, off), acc_.data(), len, scale);
      for (int k = 0; k + 1 < n; ++k) {
        const int c_recv = ((r - k - 2) % n + n) % n;
        const size_t recv_len = seg_len(c_recv, off);
        const uint64_t slot = gloo::Slot::build(kRingSlotPrefix, NextTag('r', shape));
        std::unique_ptr<gloo::transport::UnboundBuffer> acc_buf, tmp_buf;
        if (recv_len > 0) {
          tmp_buf = ctx_->createUnboundBuffer(tmp_.data(), recv_len * sizeof(float));
          tmp_buf->recv(left, slot);
        }
        if (len > 0) {
          acc_buf = ctx_->createUnboundBuffer(acc_.data(), len * sizeof(float));
          acc_buf->send(right, slot);
        }
        // When a peer fails, Gloo's transport thread signals the error to every pending buffer
        // while this thread may already be unwinding from the first one: destroying the other
        // buffer then races with that signal inside Gloo (seen under TSan). Failed buffers are
        // parked until the communicator goes away instead (at most two: the communicator fails
        // and runs no further ring step).
        try {
          if ((tmp_buf && !tmp_buf->waitRecv(opts_.timeout)) ||
              (acc_buf && !acc_buf->waitSend(opts_.timeout))) {
            throw std::runtime_error("ring step aborted");
          }
        } catch (...) {
          parked_.push_back(std::move(tmp_buf));
          parked_.push_back(std::move(acc_buf));
          throw;
        }
        AddWireBytes(op, len * sizeof(float), recv_len * sizeof(float));
        AccumulateScaled(dtype, at(c_recv, off), tmp_.data(), acc_.data(), recv_len, scale);
        len = recv_len;
      }
      StoreFloat(dtype, acc_.data(), out + off * elt, len);
    }
  }

  // fp32: Gloo's ring all-reduce in place on recv. 16-bit: the fp32 ring reduce-scatter above
  // (partial sums in fp32 on the wire) into this rank's chunk of recv, then an all-gather of the
  // rounded 16-bit chunks: 1.5x the bytes of a 16-bit ring instead of 2x for a widened all-reduce.
  void RunAllReduce(const void* send, void* recv, size_t count, DType dtype, float scale) {
    if (count == 0) return;
    if (dtype == DType::kF32) {
      LoadScaled(dtype, send, static_cast<float*>(recv), count, scale);
      if (world_size() > 1) {
        AllReduceF32(static_cast<float*>(recv), count);
        // Gloo's ring all-reduce is not instrumented: count the ring's ideal volume.
        const uint64_t ring = RingBytes(CommOp::kAllReduce, count * 4, world_size());
        AddWireBytes(CommOp::kAllReduce, ring, ring);
      }
      return;
    }
    const size_t elt = DTypeSize(dtype), n = static_cast<size_t>(world_size());
    const size_t chunk = (count + n - 1) / n;
    auto* out = static_cast<uint8_t*>(recv);
    RingReduceScatter(CommOp::kAllReduce, static_cast<const uint8_t*>(send), count, chunk, dtype,
                      scale, out + std::min(count, static_cast<size_t>(rank()) * chunk) * elt);
    if (n == 1) return;
    std::vector<size_t> counts(n);
    for (size_t c = 0; c < n; ++c) {
      counts[c] = std::min(count, (c + 1) * chunk) - std::min(count, c * chunk);
    }
    gloo::AllgathervOptions a(ctx_);
    a.setOutput(reinterpret_cast<uint16_t*>(out), counts);  // 16-bit elements
    a.setTag(NextTag('v', count));
    a.setTimeout(opts_.timeout);
    gloo::allgatherv(a);
    // Ring all-gather of the chunks: every chunk but the right neighbour's is sent, every chunk
    // but this rank's own is received.
    const size_t r = static_cast<size_t>(rank());
    AddWireBytes(CommOp::kAllReduce, (count - counts[(r + 1) % n]) * elt,
                 (count - counts[r]) * elt);
  }

  void AllReduceF32(float* buf, size_t count) {
    gloo::AllreduceOptions a(ctx_);
    a.setOutput(buf, count);
    a.setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
    a.setTag(NextTag('a', count));
    a.setTimeout(opts_.timeout);
    gloo::allreduce(a);
  }

  const GlooCommOptions opts_;
  const std::string label_;  // "split color c" for a communicator made by Split; in op names
  std::shared_ptr<gloo::Context> ctx_;
  // Worker-thread state: scratch, tags (advance identically on every rank: same op order).
  std::vector<float> acc_, tmp_;
  // Unbound buffers of a failed ring step (see RingReduceScatter); worker thread only.
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> parked_;
  uint32_t next_tag_ = 1;

  // The next operation's Gloo tag: its sequence number (the same on every rank, which run the
  // same operations in the same order) and 12 bits of a hash of its kind and size. Ranks that
  // disagree on an operation (a rank gathering another group at stage 3) then wait on different
  // slots and fail at the timeout, with an error, rather than one receiving a message larger
  // than its buffer, on which Gloo's transport thread aborts the process.
  uint32_t NextTag(char kind, uint64_t size) {
    const uint64_t h =
        ((static_cast<uint64_t>(static_cast<uint8_t>(kind)) << 56) ^ size) * 0x9E3779B97F4A7C15ull;
    return ((next_tag_++ & 0xFFFFFu) << 12) | static_cast<uint32_t>(h >> 52);
  }

  std::mutex mu_;
  std::condition_variable cv_, space_cv_;
  std::deque<Task> queue_;
  size_t running_ = 0;
  bool stop_ = false;
  Status failed_;
  uint64_t seq_ = 0;
  std::thread worker_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> CreateGlooCommunicator(const GlooCommOptions& options) {
  GlooCommOptions o = options;
  if (o.hostname.empty()) {
    const char* h = std::getenv("STRATA_GLOO_HOSTNAME");
    o.hostname = h != nullptr && *h != '\0' ? h : "127.0.0.1";
  }
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size) {
    return Status::InvalidArgument("gloo: rank " + std::to_string(o.rank) +
                                   " not in [0, world_size=" + std::to_string(o.world_size) + ")");
  }
  if (o.world_size > 1 && o.store == nullptr) {
    return Status::InvalidArgument("gloo: a rendezvous store is required for world_size > 1");
  }
  if (o.queue_depth == 0 || o.scratch_elems == 0 || o.timeout.count() <= 0) {
    return Status::InvalidArgument("gloo: queue_depth, scratch_elems and timeout must be > 0");
  }
  // Gloo's TCP transport writes with writev, which raises SIGPIPE when a peer has died; with the
  // default action that kills this rank instead of failing the collective with an error (Python,
  // and so PyTorch, ignores SIGPIPE, which is why Gloo can rely on it). Ignore it unless the
  // embedding program installed a handler of its own.
  struct sigaction old_pipe {};
  if (sigaction(SIGPIPE, nullptr, &old_pipe) == 0 && old_pipe.sa_handler == SIG_DFL &&
      !(old_pipe.sa_flags & SA_SIGINFO)) {
    signal(SIGPIPE, SIG_IGN);
  }
  std::shared_ptr<gloo::Context> ctx;  // null for world_size 1: every op is local
  std::optional<StoreAdapter> store;
  if (o.world_size > 1) {
    // Gloo's CreateDevice crashes (reads an unset addrinfo) on some hostnames that do not
    // resolve, so resolve first and report the failure ourselves.
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const int rc = ::getaddrinfo(o.hostname.c_str(), nullptr, &hints, &res);
    if (rc != 0) {
      return Status::Unavailable("gloo rendezvous (rank " + std::to_string(o.rank) + " of " +
                                 std::to_string(o.world_size) + ", transport on '" + o.hostname +
                                 "'): the hostname does not resolve: " + gai_strerror(rc));
    }
    ::freeaddrinfo(res);
    store.emplace(o.store, o.store_prefix, o.timeout);
    try {
      gloo::transport::tcp::attr attr;
      attr.hostname = o.hostname;
      auto dev = gloo::transport::tcp::CreateDevice(attr);
      auto rctx = std::make_shared<gloo::rendezvous::Context>(o.rank, o.world_size);
      rctx->setTimeout(o.timeout);
      rctx->connectFullMesh(*store, dev);
      ctx = std::move(rctx);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      const std::string msg = "gloo rendezvous (rank " + std::to_string(o.rank) + " of " +
                              std::to_string(o.world_size) + ", transport on '" + o.hostname +
                              "'): " + what;
      if (what.find("DeadlineExceeded") != std::string::npos) return Status::DeadlineExceeded(msg);
      return Status::Unavailable(msg);
    }
  }
  auto comm = std::make_unique<GlooCommunicator>(o, std::move(ctx));
  // After this barrier every rank has read the store: the caller may drop it (rank 0's TCP server).
  STRATA_ASSIGN_OR_RETURN(CommHandle h, comm->Barrier());
  STRATA_RETURN_IF_ERROR(h.WaitFor(o.timeout).WithContext("gloo setup barrier"));
  // Every peer is connected, so nobody reads this rank's address again: remove it, so that a
  // store directory reused by a later run holds no stale address. Best effort: rank 0 may already
  // have dropped its TCP store (allowed after the barrier), and keys are scoped by run id anyway.
  if (store) (void)store->DeletePublished();
  comm->ResetStats();
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace strata
