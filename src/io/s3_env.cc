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
      "{}: this build of kvtier has no S3 client (built without libcurl or pugixml)",
      options.url));
}

#else

bool S3Supported() { return true; }

namespace {

using io::S3Client;
using io::S3Request;
using io::S3Response;

std::string GetEnv(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::string(v) : std::string();
}

class S3Env;

class S3File final : public File {
 public:
  S3File(S3Env* env, std::string path, std::string key, bool writable)
      : env_(env), path_(std::move(path)), key_(std::move(key)), writable_(writable) {}

  const std::string& path() const override { return path_; }
  bool direct() const override { return true; }  // no cache between us and the server
  Status Submit(std::span<IoOp> ops, IoObserver* observer) override;
  Status Sync() override;
  Result<uint64_t> Size() override;
  Status Preallocate(uint64_t bytes) override {
    if (!writable_) return Status::InvalidArgument(fmt::format("{}: opened read-only", path_));
    Reserve(bytes);
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
    if (size_ > 0) std::memcpy(bigger.data(), data_.data(), size_);
    data_ = std::move(bigger);
  }
  Status SubmitReads(std::span<IoOp> ops, IoObserver* observer);

  S3Env* const env_;
  const std::string path_, key_;
  const bool writable_;
  // Writable: the file's content, published by Sync.
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
    auto file = std::make_unique<S3File>(this, path, key, o.write);
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
          out.push_back({p.substr(prefix.size(), p.size() - prefix.size() - 1),
                         DirEntry::Type::kDirectory});
        }
      }
      for (pugi::xml_node c : result.children("Contents")) {
        std::string k = c.child_value("Key");
        if (k.size() > prefix.size()) out.push_back({k.substr(prefix.size()), DirEntry::Type::kFile});
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
    auto head = Head(key);
    if (head.ok() || !head.status().IsNotFound()) return head;
    // Not an object: a directory if some object is below it.
    bool any = false;
    KVTIER_RETURN_IF_ERROR(ListPrefix(key + "/", true, [&](pugi::xml_node result) {
      any = any || result.child("Contents") || result.child("CommonPrefixes");
    }, 1));
    if (any) return info;
    return Status::NotFound(fmt::format("{}: no such object or prefix", path));
  }

  // The object's size and mtime (HEAD).
  Result<FileInfo> Head(const std::string& key) {
    S3Request q;
    q.method = "HEAD";
    q.key = key;
    S3Response r = client_->Execute(q);
    if (!r.ok()) return r.ToStatus(q, bucket_);
    FileInfo info;
    info.size = static_cast<uint64_t>(std::max<int64_t>(0, r.content_length));
    info.mtime_ns = r.last_modified_ns;
    info.is_regular = true;
    return info;
  }

  // Lists `prefix` page by page (ListObjectsV2), handing each <ListBucketResult> to `each`.
  Status ListPrefix(const std::string& prefix, bool delimited,
                    const std::function<void(pugi::xml_node)>& each, int max_keys = 1000) {
    std::string token;
    for (;;) {
      S3Request q;
      q.query = {{"list-type", "2"}, {"prefix", prefix}, {"max-keys", std::to_string(max_keys)}};
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
      if (max_keys < 1000 || std::string_view(result.child_value("IsTruncated")) != "true" ||
          token.empty()) {
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
  q.download = data_.first(size);
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
      Reserve(op.offset + op.len);
      std::memcpy(data_.data() + op.offset, op.buf, op.len);
      size_ = std::max<uint64_t>(size_, op.offset + op.len);
      dirty_ = true;
      op.result = static_cast<int64_t>(op.len);
    } else {
      const uint64_t n = op.offset < size_ ? std::min<uint64_t>(op.len, size_ - op.offset) : 0;
      if (n > 0) std::memcpy(op.buf, data_.data() + op.offset, n);
      op.result = static_cast<int64_t>(n);
    }
  }
  if (observer != nullptr) observer->Submitted();
  return Status::Ok();
}

Status S3File::SubmitReads(std::span<IoOp> ops, IoObserver* observer) {
  const size_t part = env_->options().part_bytes;
  struct Piece {
    size_t op;
    uint64_t start;  // within the op
  };
  std::vector<S3Request> requests;
  std::vector<Piece> pieces;
  std::vector<size_t> first_piece(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    IoOp& op = ops[i];
    if (op.kind != IoOp::Kind::kRead) {
      return Status::InvalidArgument(fmt::format("{}: opened read-only", path_));
    }
    first_piece[i] = pieces.size();
    for (uint64_t at = 0; at < op.len || (at == 0 && op.len == 0); at += part) {
      if (op.len == 0) break;
      S3Request q;
      q.key = key_;
      q.has_range = true;
      q.range_offset = op.offset + at;
      q.download = {op.buf + at, static_cast<size_t>(std::min<uint64_t>(part, op.len - at))};
      requests.push_back(std::move(q));
      pieces.push_back({i, at});
    }
  }
  std::vector<S3Response> responses(requests.size());
  // Reports each op's completed prefix as its pieces finish, in order, so that the caller's
  // checksum follows the transfer.
  std::vector<char> done(requests.size(), 0);
  std::vector<size_t> next(first_piece);
  std::vector<uint64_t> reported(ops.size(), 0);
  bool submitted = false;
  auto progress = [&](size_t k) {
    done[k] = 1;
    if (observer == nullptr) return;
    if (!submitted) observer->Submitted(), submitted = true;
    const size_t i = pieces[k].op;
    const size_t end = i + 1 < ops.size() ? first_piece[i + 1] : pieces.size();
    uint64_t upto = reported[i];
    while (next[i] < end && done[next[i]]) {
      const S3Response& r = responses[next[i]];
      if (!r.ok() || r.received != requests[next[i]].download.size()) break;
      upto = pieces[next[i]].start + r.received;
      ++next[i];
    }
    if (upto > reported[i]) {
      reported[i] = upto;
      observer->Progress(i, upto);
    }
  };
  env_->client().Execute(requests, responses, progress);
  for (size_t i = 0; i < ops.size(); ++i) {
    IoOp& op = ops[i];
    const size_t end = i + 1 < ops.size() ? first_piece[i + 1] : pieces.size();
    int64_t result = 0;
    for (size_t k = first_piece[i]; k < end; ++k) {
      const S3Response& r = responses[k];
      if (r.object_size >= 0) known_size_ = r.object_size;
      if (r.http_status == 416) break;  // the range starts at or past the end: end of file
      if (!r.ok()) {
        env_->LogFailure(requests[k], r);
        if (result == 0) result = -r.Errno();
        break;
      }
      result += static_cast<int64_t>(r.received);
      if (r.received < requests[k].download.size()) break;  // end of file
    }
    op.result = result;
  }
  return Status::Ok();
}

Status S3File::Sync() {
  if (!writable_ || !dirty_) return Status::Ok();
  S3Client& client = env_->client();
  const std::string& bucket = env_->bucket();
  const std::span<const uint8_t> body(data_.data(), size_);
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
      q.upload = body.subspan(at, std::min<uint64_t>(part, size_ - at));
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
      done.upload = {reinterpret_cast<const uint8_t*>(xml.data()), xml.size()};
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
  const auto bad = [&](std::string_view why) {
    return Status::InvalidArgument(fmt::format(
        "'{}' is not a valid S3 URL ({}); expected s3://BUCKET[/PREFIX]", options.url, why));
  };
  if (!IsS3Url(options.url)) return bad("it does not start with s3://");
  std::string_view rest = std::string_view(options.url).substr(5);
  if (rest.find_first_of("?#") != std::string_view::npos) return bad("options in the URL");
  const std::string bucket(rest.substr(0, rest.find('/')));
  if (bucket.size() < 3 || bucket.size() > 63 ||
      bucket.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789.-") != std::string::npos) {
    return bad("a bucket name is 3-63 lowercase letters, digits, '.' and '-'");
  }
  if (options.connections < 1 || options.connections > 1024) {
    return Status::InvalidArgument(
        fmt::format("S3 connections {} out of range [1, 1024]", options.connections));
  }
  if (options.part_bytes < (5u << 20) || options.part_bytes > (1u << 30)) {
    return Status::InvalidArgument("S3 part size must be between 5 MiB (S3's minimum) and 1 GiB");
  }

  io::S3ClientConfig c;
  c.bucket = bucket;
  c.region = !options.region.empty() ? options.region : GetEnv("AWS_REGION");
  if (c.region.empty()) c.region = GetEnv("AWS_DEFAULT_REGION");
  if (c.region.empty()) c.region = "us-east-1";
  std::string endpoint = !options.endpoint.empty() ? options.endpoint : GetEnv("AWS_ENDPOINT_URL_S3");
  if (endpoint.empty()) endpoint = GetEnv("AWS_ENDPOINT_URL");
  const bool user_endpoint = !endpoint.empty();
  if (!user_endpoint) endpoint = fmt::format("https://s3.{}.amazonaws.com", c.region);
  while (endpoint.ends_with('/')) endpoint.pop_back();
  if (!endpoint.starts_with("http://") && !endpoint.starts_with("https://")) {
    return Status::InvalidArgument(
        fmt::format("S3 endpoint '{}' must start with http:// or https://", endpoint));
  }
  c.endpoint = endpoint;
  if (options.addressing == "path") {
    c.path_style = true;
  } else if (options.addressing == "virtual") {
    c.path_style = false;
  } else if (options.addressing == "auto" || options.addressing.empty()) {
    c.path_style = user_endpoint;
  } else {
    return Status::InvalidArgument(fmt::format(
        "S3 addressing '{}': expected \"path\", \"virtual\" or \"auto\"", options.addressing));
  }
  c.access_key_id =
      !options.access_key_id.empty() ? options.access_key_id : GetEnv("AWS_ACCESS_KEY_ID");
  c.secret_access_key = !options.secret_access_key.empty() ? options.secret_access_key
                                                           : GetEnv("AWS_SECRET_ACCESS_KEY");
  c.session_token =
      !options.session_token.empty() ? options.session_token : GetEnv("AWS_SESSION_TOKEN");
  if (c.access_key_id.empty() || c.secret_access_key.empty()) {
    return Status::InvalidArgument(fmt::format(
        "{}: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY", options.url));
  }
  c.max_connections = options.connections;
  c.request_timeout = options.request_timeout;
  c.connect_timeout = options.connect_timeout;
  c.max_retries = options.max_retries;
  KVTIER_ASSIGN_OR_RETURN(auto client, S3Client::Create(c));

  // One listing request proves the endpoint, the credentials, the clock and the bucket.
  S3Request q;
  q.query = {{"list-type", "2"}, {"max-keys", "1"}};
  S3Response r = client->Execute(q);
  if (!r.ok()) {
    Status s = r.ToStatus(q, bucket);
    if (r.http_status == 0) {
      s = Status::Unavailable(fmt::format("{}: no S3 server answers at {}: {}", options.url,
                                          endpoint, s.message()));
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
