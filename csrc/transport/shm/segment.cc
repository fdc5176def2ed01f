#include "transport/shm/segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

#include "common/logging.h"

namespace tdx::shm {

namespace {

std::string randomToken() {
  std::random_device rd;  // /dev/urandom
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  return buf;
}

std::string errnoText(int err) { return str(std::strerror(err), " (errno ", err, ")"); }

}  // namespace

Segment::~Segment() { release(); }

Segment::Segment(Segment&& o) noexcept { *this = std::move(o); }

Segment& Segment::operator=(Segment&& o) noexcept {
  if (this != &o) {
    release();
    name_ = std::move(o.name_);
    data_ = o.data_;
    size_ = o.size_;
    owner_ = o.owner_;
    linked_ = o.linked_;
    o.data_ = nullptr;
    o.size_ = 0;
    o.owner_ = o.linked_ = false;
  }
  return *this;
}

void Segment::release() {
  if (owner_) unlink();
  if (data_) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

void Segment::unlink() {
  if (owner_ && linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

Segment Segment::create(size_t bytes) {
  Segment s;
  // The pid lets a later start remove what a killed process left; the random part makes
  // the name impossible to guess or pre-create.
  s.name_ = str("/", kSegmentPrefix, getpid(), "-", randomToken());
  int fd = shm_open(s.name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  TDX_ENFORCE(fd >= 0, "cannot create shared-memory segment ", s.name_, ": ", errnoText(errno),
              (errno == EEXIST ? "; a segment with this name already exists and is not reused" : ""));
  s.owner_ = s.linked_ = true;
  s.size_ = bytes;
  // Reserve the pages now so a full /dev/shm is an error here, not a SIGBUS later.
  int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (rc != 0) {
    close(fd);
    s.size_ = 0;
    std::string name = s.name_;
    s.unlink();
    TDX_ENFORCE(false, "cannot reserve ", bytes, " bytes of shared memory for ", name, ": ", errnoText(rc),
                "; free space in /dev/shm, or lower TDX_BUFFER_BYTES / TDX_P2P_RING_BYTES");
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    s.size_ = 0;
    s.unlink();
    TDX_ENFORCE(false, "cannot map shared-memory segment of ", bytes, " bytes: ", errnoText(err));
  }
  s.data_ = static_cast<char*>(p);
  return s;
}

Segment Segment::open(const std::string& name, size_t bytes) {
  Segment s;
  s.name_ = name;
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  TDX_ENFORCE(fd >= 0, "cannot open peer shared-memory segment ", name, ": ", errnoText(errno),
              "; all ranks of a tdx group must run on the same host (set TDX_NODE_ID per host "
              "only when they do not) and as the same user");
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    close(fd);
    TDX_ENFORCE(false, "peer segment ", name, " has ", static_cast<long long>(st.st_size), " bytes, expected ", bytes,
                "; every rank must use the same TDX_BUFFER_BYTES and TDX_P2P_RING_BYTES");
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  TDX_ENFORCE(p != MAP_FAILED, "cannot map peer segment ", name, ": ", errnoText(err));
  s.data_ = static_cast<char*>(p);
  s.size_ = bytes;
  return s;
}

int removeStaleSegments() {
  DIR* dir = opendir("/dev/shm");
  if (!dir) return 0;
  int removed = 0;
  const size_t plen = std::strlen(kSegmentPrefix);
  while (dirent* e = readdir(dir)) {
    if (std::strncmp(e->d_name, kSegmentPrefix, plen) != 0) continue;
    long pid = std::strtol(e->d_name + plen, nullptr, 10);
    if (pid <= 0) continue;
    if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      if (shm_unlink((std::string("/") + e->d_name).c_str()) == 0) ++removed;
    }
  }
  closedir(dir);
  return removed;
}

}  // namespace tdx::shm
