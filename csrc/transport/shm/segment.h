// A POSIX shared-memory segment: created 0600 with O_EXCL under an unguessable name,
// mapped by every rank of a group, and unlinked as soon as all ranks have mapped it,
// so nothing stays in /dev/shm even if a process is killed later.
#pragma once

#include <cstddef>
#include <string>

namespace tdx::shm {

class Segment {
 public:
  Segment() = default;
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  Segment(Segment&& o) noexcept;
  Segment& operator=(Segment&& o) noexcept;

  // Creates a new segment of `bytes` bytes; refuses a name that already exists.
  static Segment create(size_t bytes);
  // Maps a segment another rank created; checks it has `bytes` bytes.
  static Segment open(const std::string& name, size_t bytes);

  // Removes the name from /dev/shm (the mapping stays valid). Idempotent.
  void unlink();

  char* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  void release();
  std::string name_;
  char* data_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;   // created here: unlink on destruction if still linked
  bool linked_ = false;
};

// The prefix of every tdx segment name in /dev/shm.
constexpr const char* kSegmentPrefix = "tdx-";

// Unlinks tdx segments whose creating process no longer exists (left by a killed rank).
// Returns how many were removed.
int removeStaleSegments();

}  // namespace tdx::shm
