// The one adapter from a c10d store to the transport's Rendezvous (keys and string values), with
// an optional key prefix (each host's shared-memory group has its own namespace).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>
#include <utility>
#include <vector>

#include "transport/transport.h"

namespace tdx {

class StoreRendezvous : public Rendezvous {
 public:
  explicit StoreRendezvous(c10::intrusive_ptr<c10d::Store> store, std::string prefix = "")
      : store_(std::move(store)), prefix_(std::move(prefix)) {}
  void set(const std::string& key, const std::string& value) override {
    store_->set(prefix_ + key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key) override {
    auto v = store_->get(prefix_ + key);
    return std::string(v.begin(), v.end());
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
};

}  // namespace tdx
