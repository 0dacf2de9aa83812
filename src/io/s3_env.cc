// The S3 Env: files as objects of one bucket, through S3Client (libcurl, SigV4).
//
// Paths are URLs, `s3://BUCKET/KEY`; a "directory" is a key prefix ending in '/', which exists
// as long as some object is below it. A File opened for reading sends nothing until its first
// Submit, which turns every op into ranged GETs of `part_bytes`, all in flight at once. A File
// opened for writing is a buffer in memory: Submit copies into it, Sync uploads it whole.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/log_limiter.h"
#include "io/s3_client.h"
#include "io/s3_raw.h"
#include "kvtier/io.h"

#ifdef KVTIER_WITH_S3
#include "pugixml.hpp"
#endif

namespace kvtier {

bool IsS3Url(std::string_view path) { return path.starts_with("s3://"); }

#ifndef KVTIER_WITH_S3

bool S3Supported() { return false; }
Result<std::unique_ptr<Env>> NewS3Env(const S3EnvOptions& options) {
  return Status::Unimplemented(fmt::format(
      "{}: this build of kvtier has no S3 client (built without libcurl or pugixml)", options.url));
}

namespace io {
class S3RawClient::Impl {};
Result<std::unique_ptr<S3RawClient>> S3RawClient::Connect(const std::string& url) {
  return Status::Unimplemented(fmt::format("{}: this build of kvtier has no S3 client", url));
}
S3RawClient::~S3RawClient() = default;
Status S3RawClient::WriteFile(const std::string&, std::span<const uint8_t>) {
  return Status::Unimplemented("no S3 client");
}
Status S3RawClient::ReadFile(const std::string&, std::span<uint8_t>) {
  return Status::Unimplemented("no S3 client");
}
}  // namespace io

#else

bool S3Supported() { return true; }

namespace {

using io::S3Client;
using io::S3Request;
using io::S3Response;

class S3Env;

// Bytes [at, at + len) of the concatenation of `spans`.
std::vector<std::span<const uint8_t>> Slice(const std::vector<std::span<const uint8_t>>& spans,
                                            uint64_t at, uint64_t len) {
  std::vector<std::span<const uint8_t>> out;
  for (std::span<const uint8_t> s : spans) {
    if (len == 0) break;
    if (at >= s.size()) {
      at -= s.size();
      continue;
    }
    const uint64_t take = std::min<uint64_t>(len, s.size() - at);
    out.push_back(s.subspan(at, take));
    len -= take;
    at = 0;
  }
  return out;
}

class S3File final : public File {
 public:
  S3File(S3Env* env, std::string path, std::string key, bool writable, bool borrow)
      : env_(env),
        path_(std::move(path)),
        key_(std::move(key)),
        writable_(writable),
        borrow_(borrow) {}

  const std::string& path() const override { return path_; }
  bool direct() const override { return true; }  // no cache between us and the server
  Status Submit(std::span<IoOp> ops, IoObserver* observer) override;
  Status Sync() override;
  Result<uint64_t> Size() override;
  Status Preallocate(uint64_t bytes) override {
    if (!writable_) return Status::InvalidArgument(fmt::format("{}: opened read-only", path_));
    if (!borrow_) Reserve(bytes);
    if (size_ < bytes) size_ = bytes, dirty_ = true;
    return Status::Ok();
  }

  // Fills the buffer with the object's current content, `size` bytes (a write open without
  // truncation).
  Status Load(uint64_t size);

 private:
  void Reserve(uint64_t bytes) {
    if (data_.size() >= bytes) return;
    AlignedBuffer bigger(std::max<uint64_t>(bytes, data_.size() * 2));
    if (data_.size() > 0) std::memcpy(bigger.data(), data_.data(), std::min(size_, data_.size()));
    data_ = std::move(bigger);
  }
  // Copies the borrowed buffers into data_ and stops borrowing.
  void Materialize() {
    if (!borrow_) return;
    borrow_ = false;
    Reserve(size_);
    for (const Extent& e : extents_) {
      if (!e.data.empty()) std::memcpy(data_.data() + e.offset, e.data.data(), e.data.size());
    }
    extents_.clear();
  }
  // The file's bytes in order: the borrowed buffers where they tile the file exactly, else
  // (after Materialize) the file's own buffer.
  std::vector<std::span<const uint8_t>> Body() {
    if (borrow_) {
      std::sort(extents_.begin(), extents_.end(),
                [](const Extent& a, const Extent& b) { return a.offset < b.offset; });
      std::vector<std::span<const uint8_t>> body;
      uint64_t at = 0;
      for (const Extent& e : extents_) {
        if (e.offset != at) break;
        body.push_back(e.data);
        at += e.data.size();
      }
      if (at == size_ && body.size() == extents_.size()) return body;
      Materialize();
    }
    return {std::span<const uint8_t>(data_.data(), size_)};
  }
  Status SubmitReads(std::span<IoOp> ops, IoObserver* observer);

  S3Env* const env_;
  const std::string path_, key_;
  const bool writable_;
  // Writable: the file's content, published by Sync. Borrowed (OpenOptions::
  // buffers_outlive_file): the caller's buffers as written, else copied into data_.
  bool borrow_;
  struct Extent {
    uint64_t offset;
    std::span<const uint8_t> data;
  };
  std::vector<Extent> extents_;
  AlignedBuffer data_;  // zero-filled beyond size_
  uint64_t size_ = 0;
  bool dirty_ = false;
  // Read-only: the object's size once an answer said it.
  int64_t known_size_ = -1;
};

class S3Env final : public Env {
 public:
  S3Env(const S3EnvOptions& options, std::string bucket, std::unique_ptr<S3Client> client)
      : options_(options), bucket_(std::move(bucket)), client_(std::move(client)) {}

  std::string io_engine_name() const override { return "s3"; }
  uint64_t direct_fallbacks() const override { return 0; }
  bool publishes_at_sync() const override { return true; }

  Result<std::unique_ptr<File>> Open(const std::string& path, const OpenOptions& o) override {
    KVTIER_ASSIGN_OR_RETURN(std::string key, Key(path));
    if (key.empty()) return Status::InvalidArgument(fmt::format("{} is the bucket", path));
    auto file =
        std::make_unique<S3File>(this, path, key, o.write, o.write && o.buffers_outlive_file);
    if (!o.write) return std::unique_ptr<File>(std::move(file));
    if (o.exclusive || !o.truncate) {
      // An object store has no exclusive create; this check is racy across writers, which is
      // why publishing writers (publishes_at_sync) never ask for it.
      auto info = Head(key);
      if (info.ok()) {
        if (o.exclusive) return Status::IOError(fmt::format("{}: file exists", path));
        KVTIER_RETURN_IF_ERROR(file->Load(info->size));
      } else if (!info.status().IsNotFound()) {
        return info.status();
      } else if (!o.create) {
        return Status::NotFound(fmt::format("{}: no such object", path));
      }
    }
    return std::unique_ptr<File>(std::move(file));
  }

  Status Rename(const std::string& from, const std::string& to) override {
    KVTIER_ASSIGN_OR_RETURN(std::string src, Key(from));
    KVTIER_ASSIGN_OR_RETURN(std::string dst, Key(to));
    S3Request q;
    q.method = "PUT";
    q.key = dst;
    q.headers.push_back(
        fmt::format("x-amz-copy-source: /{}/{}", bucket_, io::UriEncode(src, true)));
    S3Response r = client_->Execute(q);
    // A copy can fail after its 200 header was sent: the error is then the body.
    if (r.ok()) io::ParseS3Error(r.body, &r.error_code, &r.error_message);
    if (!r.ok() || !r.error_code.empty()) {
      if (r.ok()) r.http_status = 500;
      return r.ToStatus(q, bucket_);
    }
    return Unlink(from);
  }

  Status Unlink(const std::string& path) override {
    KVTIER_ASSIGN_OR_RETURN(std::string key, Key(path));
    S3Request q;
    q.method = "DELETE";
    q.key = key;
    S3Response r = client_->Execute(q);
    if (!r.ok() && r.http_status != 404) return r.ToStatus(q, bucket_);
    return Status::Ok();
  }

  Status CreateDirs(const std::string& path) override { return Key(path).status(); }
  Status RemoveDir(const std::string& path) override { return Key(path).status(); }
  Status SyncDir(const std::string& path) override { return Key(path).status(); }

  Result<std::vector<DirEntry>> List(const std::string& dir) override {
    KVTIER_ASSIGN_OR_RETURN(std::string key, Key(dir));
    std::vector<DirEntry> out;
    const std::string prefix = key.empty() ? key : key + "/";
    KVTIER_RETURN_IF_ERROR(ListPrefix(prefix, true, [&](pugi::xml_node result) {
      for (pugi::xml_node c : result.children("CommonPrefixes")) {
        std::string p = c.child_value("Prefix");
        if (p.size() > prefix.size() + 1) {
          out.push_back(
              {p.substr(prefix.size(), p.size() - prefix.size() - 1), DirEntry::Type::kDirectory});
        }
      }
      for (pugi::xml_node c : result.children("Contents")) {
        std::string k = c.child_value("Key");
        if (k.size() > prefix.size())
          out.push_back({k.substr(prefix.size()), DirEntry::Type::kFile});
      }
    }));
    return out;
  }

  Result<std::vector<TreeEntry>> ListTree(const std::string& dir) override {
    KVTIER_ASSIGN_OR_RETURN(std::string key, Key(dir));
    std::vector<TreeEntry> out;
    const std::string prefix = key.empty() ? key : key + "/";
    KVTIER_RETURN_IF_ERROR(ListPrefix(prefix, false, [&](pugi::xml_node result) {
      for (pugi::xml_node c : result.children("Contents")) {
        std::string k = c.child_value("Key");
        if (k.size() <= prefix.size() || k.back() == '/') continue;  // folder markers
        TreeEntry e;
        e.path = k.substr(prefix.size());
        e.info.size = std::strtoull(c.child_value("Size"), nullptr, 10);
        e.info.mtime_ns = io::ParseHttpTime(c.child_value("LastModified"));
        e.info.is_regular = true;
        out.push_back(std::move(e));
      }
    }));
    return out;
  }

  Result<FileInfo> Stat(const std::string& path) override {
    KVTIER_ASSIGN_OR_RETURN(std::string key, Key(path));
    FileInfo info;
    info.is_directory = true;
    if (key.empty()) return info;  // the bucket (checked at creation)
    // The object (HEAD) or, failing that, a directory: some object below it (a one-key
    // listing). Both at once, so that a miss costs one round trip, not two.
    std::vector<S3Request> q(2);
    q[0].method = "HEAD";
    q[0].key = key;
    q[1].query = {{"list-type", "2"}, {"prefix", key + "/"}, {"max-keys", "1"}};
    std::vector<S3Response> r(2);
    client_->Execute(q, r);
    if (r[0].ok()) return HeadInfo(r[0]);
    if (r[0].http_status != 404) return r[0].ToStatus(q[0], bucket_);
    if (!r[1].ok()) return r[1].ToStatus(q[1], bucket_);
    if (r[1].body.find("<Key>") != std::string::npos) return info;
    return Status::NotFound(fmt::format("{}: no such object or prefix", path));
  }

  // The object's size and mtime (HEAD).
  Result<FileInfo> Head(const std::string& key) {
    S3Request q;
    q.method = "HEAD";
    q.key = key;
    S3Response r = client_->Execute(q);
    if (!r.ok()) return r.ToStatus(q, bucket_);
    return HeadInfo(r);
  }
  static FileInfo HeadInfo(const S3Response& r) {
    FileInfo info;
    info.size = static_cast<uint64_t>(std::max<int64_t>(0, r.content_length));
    info.mtime_ns = r.last_modified_ns;
    info.is_regular = true;
    return info;
  }

  // Lists `prefix` page by page (ListObjectsV2), handing each <ListBucketResult> to `each`.
  Status ListPrefix(const std::string& prefix, bool delimited,
                    const std::function<void(pugi::xml_node)>& each) {
    std::string token;
    for (;;) {
      S3Request q;
      q.query = {{"list-type", "2"},
                 {"prefix", prefix},
                 {"max-keys", std::to_string(options_.list_page_keys)}};
      if (delimited) q.query["delimiter"] = "/";
      if (!token.empty()) q.query["continuation-token"] = token;
      S3Response r = client_->Execute(q);
      if (!r.ok()) return r.ToStatus(q, bucket_);
      pugi::xml_document doc;
      pugi::xml_node result;
      if (doc.load_buffer(r.body.data(), r.body.size())) result = doc.child("ListBucketResult");
      if (!result) {
        return Status::IOError(fmt::format("listing s3://{}/{}: not a ListBucketResult: {:.200}",
                                           bucket_, prefix, r.body));
      }
      each(result);
      token = result.child_value("NextContinuationToken");
      if (std::string_view(result.child_value("IsTruncated")) != "true" || token.empty()) {
        return Status::Ok();
      }
    }
  }

  // The object key of an s3:// path of this bucket ("" for the bucket itself).
  Result<std::string> Key(const std::string& path) const {
    const std::string root = fmt::format("s3://{}", bucket_);
    if (!path.starts_with(root) || (path.size() > root.size() && path[root.size()] != '/')) {
      return Status::InvalidArgument(
          fmt::format("{} is not in this S3 env's bucket ({})", path, root));
    }
    std::string key;
    for (char c : std::string_view(path).substr(root.size())) {
      if (c == '/' && (key.empty() || key.back() == '/')) continue;  // collapse "//", drop "/"
      key.push_back(c);
    }
    while (!key.empty() && key.back() == '/') key.pop_back();
    return key;
  }

  // Logs a failed data request at a limited rate (its errno is all the File's caller sees).
  void LogFailure(const S3Request& q, const S3Response& r) {
    if (r.http_status == 404) return;  // a miss, not a failure
    if (auto held = failure_log_.Allow()) {
      spdlog::warn("S3: {}{}", r.Describe(q, bucket_), LogLimiter::Suppressed(*held));
    }
  }

  S3Client& client() { return *client_; }
  const S3EnvOptions& options() const { return options_; }
  const std::string& bucket() const { return bucket_; }

 private:
  const S3EnvOptions options_;
  const std::string bucket_;
  std::unique_ptr<S3Client> client_;
  LogLimiter failure_log_;
};

Status S3File::Load(uint64_t size) {
  Reserve(size);
  S3Request q;
  q.key = key_;
  q.download = {data_.first(size)};
  S3Response r = env_->client().Execute(q);
  if (!r.ok()) return r.ToStatus(q, env_->bucket());
  if (r.received != size) {
    return Status::IOError(
        fmt::format("{}: {} bytes read of {} (changed meanwhile?)", path_, r.received, size));
  }
  size_ = size;
  return Status::Ok();
}

Status S3File::Submit(std::span<IoOp> ops, IoObserver* observer) {
  if (!writable_) return SubmitReads(ops, observer);
  for (IoOp& op : ops) {
    if (op.kind == IoOp::Kind::kWrite) {
      if (borrow_) {
        extents_.push_back({op.offset, {op.buf, op.len}});
      } else {
        Reserve(op.offset + op.len);
        if (op.len > 0) std::memcpy(data_.data() + op.offset, op.buf, op.len);
      }
      size_ = std::max<uint64_t>(size_, op.offset + op.len);
      dirty_ = true;
      op.result = static_cast<int64_t>(op.len);
    } else {
      Materialize();
      const uint64_t n = op.offset < size_ ? std::min<uint64_t>(op.len, size_ - op.offset) : 0;
      if (n > 0) std::memcpy(op.buf, data_.data() + op.offset, n);
      op.result = static_cast<int64_t>(n);
    }
  }
  if (observer != nullptr) observer->Submitted();
  return Status::Ok();
}

Status S3File::SubmitReads(std::span<IoOp> ops, IoObserver* observer) {
  const uint64_t part = env_->options().part_bytes;
  // Ops that follow each other in the file (a chunk's header and payload) share their requests:
  // one range, cut into parts of `part_bytes`, each part's answer scattered over the ops'
  // buffers. A segment is the piece of one op that one request carries.
  struct Segment {
    size_t op;
    uint64_t start, len;  // within the op
    size_t request;
    uint64_t got = 0;
  };
  std::vector<S3Request> requests;
  std::vector<Segment> segments;      // request by request, in file order
  std::vector<size_t> first_segment;  // of each request, and one past the last
  std::vector<std::vector<size_t>> op_segments(ops.size());
  for (size_t i = 0; i < ops.size();) {
    if (ops[i].kind != IoOp::Kind::kRead) {
      return Status::InvalidArgument(fmt::format("{}: opened read-only", path_));
    }
    size_t j = i + 1;
    uint64_t total = ops[i].len;
    while (j < ops.size() && ops[j].kind == IoOp::Kind::kRead &&
           ops[j].offset == ops[j - 1].offset + ops[j - 1].len) {
      total += ops[j++].len;
    }
    size_t op = i;
    uint64_t within = 0;
    for (uint64_t at = 0; at < total; at += part) {
      S3Request q;
      q.key = key_;
      q.has_range = true;
      q.range_offset = ops[i].offset + at;
      first_segment.push_back(segments.size());
      for (uint64_t n = std::min(part, total - at); n > 0;) {
        while (ops[op].len == within) ++op, within = 0;  // past the op (or an empty one)
        const uint64_t take = std::min(n, ops[op].len - within);
        q.download.push_back({ops[op].buf + within, static_cast<size_t>(take)});
        op_segments[op].push_back(segments.size());
        segments.push_back({op, within, take, requests.size()});
        within += take;
        n -= take;
      }
      requests.push_back(std::move(q));
    }
    i = j;
  }
  first_segment.push_back(segments.size());
  std::vector<S3Response> responses(requests.size());
  // Hands each request's bytes to its segments as they arrive, then reports every op's completed
  // prefix, so that the caller's checksum follows the transfer.
  std::vector<size_t> next(ops.size(), 0);
  std::vector<uint64_t> reported(ops.size(), 0);
  bool submitted = false;
  auto progress = [&](size_t r, uint64_t bytes, bool finished) {
    if (finished && !responses[r].ok()) bytes = 0;
    for (size_t k = first_segment[r]; k < first_segment[r + 1]; ++k) {
      segments[k].got = std::min(bytes, segments[k].len);
      bytes -= segments[k].got;
    }
    if (observer == nullptr) return;
    if (!submitted) observer->Submitted(), submitted = true;
    for (size_t k = first_segment[r]; k < first_segment[r + 1]; ++k) {
      const size_t op = segments[k].op;
      uint64_t upto = reported[op];
      const auto& mine = op_segments[op];
      while (next[op] < mine.size()) {
        const Segment& s = segments[mine[next[op]]];
        if (s.got != s.len) break;
        upto = s.start + s.len;
        ++next[op];
      }
      if (upto > reported[op]) {
        reported[op] = upto;
        observer->Progress(op, upto);
      }
    }
  };
  env_->client().Execute(requests, responses, progress);
  for (size_t r = 0; r < requests.size(); ++r) {
    if (responses[r].object_size >= 0) known_size_ = responses[r].object_size;
    if (!responses[r].ok() && responses[r].http_status != 416) {
      env_->LogFailure(requests[r], responses[r]);
    }
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    int64_t result = 0;
    for (size_t k : op_segments[i]) {
      const Segment& s = segments[k];
      const S3Response& resp = responses[s.request];
      if (!resp.ok()) {
        // 416: the range starts at or past the end (end of file); anything else is an error,
        // unless some bytes came first (a short transfer, which the caller retries).
        if (resp.http_status != 416 && result == 0) result = -resp.Errno();
        break;
      }
      result += static_cast<int64_t>(s.got);
      if (s.got < s.len) break;  // end of file
    }
    ops[i].result = result;
  }
  return Status::Ok();
}

Status S3File::Sync() {
  if (!writable_ || !dirty_) return Status::Ok();
  S3Client& client = env_->client();
  const std::string& bucket = env_->bucket();
  const std::vector<std::span<const uint8_t>> body = Body();
  const size_t part = env_->options().part_bytes;
  if (size_ <= env_->options().multipart_threshold) {
    S3Request q;
    q.method = "PUT";
    q.key = key_;
    q.upload = body;
    S3Response r = client.Execute(q);
    if (!r.ok()) return r.ToStatus(q, bucket);
  } else {
    // Multipart: start, every part at once, complete (or abort on any failure).
    S3Request start;
    start.method = "POST";
    start.key = key_;
    start.query = {{"uploads", ""}};
    S3Response sr = client.Execute(start);
    if (!sr.ok()) return sr.ToStatus(start, bucket);
    pugi::xml_document doc;
    doc.load_buffer(sr.body.data(), sr.body.size());
    const std::string upload_id =
        doc.child("InitiateMultipartUploadResult").child_value("UploadId");
    if (upload_id.empty()) {
      return Status::IOError(fmt::format("{}: no UploadId in the answer: {:.200}", path_, sr.body));
    }
    std::vector<S3Request> parts;
    for (uint64_t at = 0; at < size_; at += part) {
      S3Request q;
      q.method = "PUT";
      q.key = key_;
      q.query = {{"partNumber", std::to_string(parts.size() + 1)}, {"uploadId", upload_id}};
      q.upload = Slice(body, at, std::min<uint64_t>(part, size_ - at));
      parts.push_back(std::move(q));
    }
    std::vector<S3Response> answers(parts.size());
    client.Execute(parts, answers);
    Status failed;
    std::string xml = "<CompleteMultipartUpload>";
    for (size_t i = 0; i < parts.size() && failed.ok(); ++i) {
      if (!answers[i].ok()) failed = answers[i].ToStatus(parts[i], bucket);
      xml += fmt::format("<Part><PartNumber>{}</PartNumber><ETag>{}</ETag></Part>", i + 1,
                         answers[i].etag);
    }
    xml += "</CompleteMultipartUpload>";
    if (failed.ok()) {
      S3Request done;
      done.method = "POST";
      done.key = key_;
      done.query = {{"uploadId", upload_id}};
      done.headers.push_back("Content-Type: application/xml");  // not curl's form default
      done.upload = {{reinterpret_cast<const uint8_t*>(xml.data()), xml.size()}};
      S3Response dr = client.Execute(done);
      if (dr.ok()) io::ParseS3Error(dr.body, &dr.error_code, &dr.error_message);
      if (!dr.ok() || !dr.error_code.empty()) {
        if (dr.ok()) dr.http_status = 500;
        failed = dr.ToStatus(done, bucket);
      }
    }
    if (!failed.ok()) {
      S3Request abort;
      abort.method = "DELETE";
      abort.key = key_;
      abort.query = {{"uploadId", upload_id}};
      (void)client.Execute(abort);
      return failed;
    }
  }
  dirty_ = false;
  return Status::Ok();
}

Result<uint64_t> S3File::Size() {
  if (writable_) return size_;
  if (known_size_ >= 0) return static_cast<uint64_t>(known_size_);
  KVTIER_ASSIGN_OR_RETURN(FileInfo info, env_->Head(key_));
  known_size_ = static_cast<int64_t>(info.size);
  return info.size;
}

}  // namespace

Result<std::unique_ptr<Env>> NewS3Env(const S3EnvOptions& options) {
  KVTIER_ASSIGN_OR_RETURN(io::S3ClientConfig c, io::ResolveS3Config(options));
  const std::string& bucket = c.bucket;
  const std::string& endpoint = c.endpoint;
  KVTIER_ASSIGN_OR_RETURN(auto client, S3Client::Create(c));

  // One listing request proves the endpoint, the credentials, the clock and the bucket.
  S3Request q;
  q.query = {{"list-type", "2"}, {"max-keys", "1"}};
  S3Response r = client->Execute(q);
  if (!r.ok()) {
    Status s = r.ToStatus(q, bucket);
    if (r.http_status == 0) {
      s = Status::Unavailable(
          fmt::format("{}: no S3 server answers at {}: {}", options.url, endpoint, s.message()));
    } else if (r.error_code == "NoSuchBucket") {
      s = Status::NotFound(fmt::format("{}: the bucket does not exist at {}: {}", options.url,
                                       endpoint, s.message()));
    }
    return s;
  }
  return std::unique_ptr<Env>(new S3Env(options, bucket, std::move(client)));
}

#endif  // KVTIER_WITH_S3

}  // namespace kvtier
