// One chunk of a push message apart from its bytes: every field but `data`,
// and `data` as pieces over the received message (server/grad_message.h
// reads them; PushSession takes them).
#pragma once

#include "base/pieces.h"
#include "shardopt/v1/optimizer.pb.h"

namespace shardopt {

struct GradPart {
  v1::GradChunk head;  // its data cleared
  Pieces data;
};

}  // namespace shardopt
