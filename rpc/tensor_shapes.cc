#include "rpc/tensor_shapes.h"

#include <vector>

#include "google/protobuf/util/message_differencer.h"

namespace shardopt {
namespace {

using google::protobuf::util::MessageDifferencer;

// A TensorSpec's shape that one side leaves empty; the differencer owns it.
class ShapeOnOneSide final : public MessageDifferencer::IgnoreCriteria {
 public:
  bool IsIgnored(const google::protobuf::Message& a, const google::protobuf::Message& b,
                 const google::protobuf::FieldDescriptor* field,
                 const std::vector<MessageDifferencer::SpecificField>&) override {
    return field == shape_ &&
           (a.GetReflection()->FieldSize(a, field) == 0 || b.GetReflection()->FieldSize(b, field) == 0);
  }

 private:
  const google::protobuf::FieldDescriptor* const shape_ =
      v1::TensorSpec::descriptor()->FindFieldByNumber(v1::TensorSpec::kShapeFieldNumber);
};

}  // namespace

void CompareShapesOnlyWhereBothGiveThem(MessageDifferencer* differ) { differ->AddIgnoreCriteria(new ShapeOnOneSide); }

}  // namespace shardopt
