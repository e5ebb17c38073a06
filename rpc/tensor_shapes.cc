#include "rpc/tensor_shapes.h"

#include <vector>

#include "google/protobuf/util/message_differencer.h"

namespace shardopt {
namespace {

using google::protobuf::util::MessageDifferencer;

// A TensorSpec's shape that one side leaves empty, or a trainers_per_rank
// that one side leaves 0; the differencer owns it.
class SaidOnOneSide final : public MessageDifferencer::IgnoreCriteria {
 public:
  bool IsIgnored(const google::protobuf::Message& a, const google::protobuf::Message& b,
                 const google::protobuf::FieldDescriptor* field,
                 const std::vector<MessageDifferencer::SpecificField>&) override {
    if (field == shape_) {
      return a.GetReflection()->FieldSize(a, field) == 0 || b.GetReflection()->FieldSize(b, field) == 0;
    }
    return field == trainers_ && (a.GetReflection()->GetUInt32(a, field) == 0 ||
                                  b.GetReflection()->GetUInt32(b, field) == 0);
  }

 private:
  const google::protobuf::FieldDescriptor* const shape_ =
      v1::TensorSpec::descriptor()->FindFieldByNumber(v1::TensorSpec::kShapeFieldNumber);
  const google::protobuf::FieldDescriptor* const trainers_ =
      v1::CreateJobRequest::descriptor()->FindFieldByNumber(v1::CreateJobRequest::kTrainersPerRankFieldNumber);
};

}  // namespace

void CompareOnlyWhereBothSayIt(MessageDifferencer* differ) { differ->AddIgnoreCriteria(new SaidOnOneSide); }

}  // namespace shardopt
