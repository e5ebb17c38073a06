// What CreateJob answers say about attaching (client/attach_answers.h):
// pure functions, no network. The integration side, with real servers, is
// DurabilityTest.ARestartedTrainerCompletesAStepCommittedOnSomeServersOnly.
#include "client/attach_answers.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardopt {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::CreateJobResponse At(uint64_t step, uint64_t sealed, double lr = 1e-3) {
  v1::CreateJobResponse a;
  a.set_step(step);
  a.set_sealed_step(sealed);
  a.set_applied_lr(lr);
  a.set_applied_gscale(0.5f);
  a.add_applied_group_lr(lr);
  return a;
}

TEST(AttachAnswers, AHalfCommittedStepIsCompletedWithTheArgumentsItWasAppliedWith) {
  // Server 2 holds no part: its answer, whatever it says, is not asked.
  const std::vector<v1::CreateJobResponse> answers = {At(5, 5, 3e-4), At(4, 5), At(0, 0)};
  const auto half = FindHalfCommittedStep(answers, {true, true, false});
  ASSERT_TRUE(half.has_value());
  EXPECT_THAT(half->behind, ElementsAre(1u));
  EXPECT_EQ(half->commit.step(), 5u);
  EXPECT_EQ(half->commit.lr(), 3e-4);
  EXPECT_EQ(half->commit.gscale(), 0.5f);
  EXPECT_THAT(half->commit.group_lr(), ElementsAre(3e-4));
}

// Servers ahead that skipped the step agree whatever numbers they report
// (an older server records a skip's lr and gscale as sent), and the servers
// behind are sent a skip as every skip is sent; a skip and an applied step
// still disagree.
TEST(AttachAnswers, AHalfCommittedSkipIsCompletedAsASkipWhateverNumbersItWasSentWith) {
  std::vector<v1::CreateJobResponse> answers = {At(5, 5, 3e-4), At(5, 5, 7.0), At(4, 5)};
  answers[0].set_applied_skip(true);
  answers[1].set_applied_skip(true);
  const auto half = FindHalfCommittedStep(answers, {true, true, true});
  ASSERT_TRUE(half.has_value());
  EXPECT_THAT(half->behind, ElementsAre(2u));
  EXPECT_TRUE(half->commit.skip());
  EXPECT_EQ(half->commit.lr(), 0.0);
  EXPECT_EQ(half->commit.gscale(), 1.0f);
  EXPECT_TRUE(half->commit.group_lr().empty());
  answers[1].set_applied_skip(false);
  EXPECT_FALSE(FindHalfCommittedStep(answers, {true, true, true}).has_value());
}

TEST(AttachAnswers, NothingIsCompletedUnlessEveryServerKeepsTheStepsRoundAndTheArgumentsAgree) {
  const std::vector<bool> both = {true, true};
  EXPECT_FALSE(FindHalfCommittedStep({At(5, 5), At(5, 5)}, both).has_value());  // agreed
  EXPECT_FALSE(FindHalfCommittedStep({At(6, 6), At(4, 5)}, both).has_value());  // two steps apart
  EXPECT_FALSE(FindHalfCommittedStep({At(5, 5), At(4, 0)}, both).has_value());  // behind keeps no round
  EXPECT_FALSE(FindHalfCommittedStep({At(5, 5), At(5, 5, 2e-3), At(4, 5)}, {true, true, true}).has_value());
  EXPECT_FALSE(FindHalfCommittedStep({At(5, 5), At(4, 5)}, {false, false}).has_value());  // no part anywhere
}

// One step apart is what an attach asks about again (a view torn by a
// commit in flight); agreed, two steps apart, or no part anywhere is not.
TEST(AttachAnswers, OnlyServersOneStepApartAreWorthAskingAgain) {
  const std::vector<bool> both = {true, true};
  EXPECT_TRUE(OneStepApart({At(5, 5), At(4, 0)}, both));
  EXPECT_TRUE(OneStepApart({At(4, 0), At(9, 9), At(5, 5)}, {true, false, true}));
  EXPECT_FALSE(OneStepApart({At(5, 5), At(5, 5)}, both));
  EXPECT_FALSE(OneStepApart({At(6, 6), At(4, 5)}, both));
  EXPECT_FALSE(OneStepApart({At(5, 5), At(4, 5)}, {false, false}));
}

// A re-attach that finds the job there already (another trainer's attach
// restored it a moment before) is not told "has no checkpoint of it", as a
// probe's ranks relaunched at once were.
TEST(AttachAnswers, AReattachSaysWhatTheServerDid) {
  v1::CreateJobResponse restored = At(2, 0), held = At(2, 0), fresh = At(0, 0);
  restored.set_created(true);
  restored.set_restored(true);
  fresh.set_created(true);
  EXPECT_EQ(ReattachOutcome(restored), "restored step 2");
  EXPECT_THAT(ReattachOutcome(held), HasSubstr("holds it at step 2 (another trainer's attach"));
  EXPECT_EQ(ReattachOutcome(fresh), "has no checkpoint of it");
}

TEST(AttachAnswers, ServersThatDisagreeAreNamedWithTheirSteps) {
  EXPECT_EQ(AgreedStep({At(3, 3), At(9, 9), At(3, 3)}, {true, false, true}, {"a:1", "b:2", "c:3"}, "j").value(), 3u);
  const auto refused = AgreedStep({At(3, 3), At(2, 2)}, {true, true}, {"a:1", "b:2"}, "j");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("a:1 at step 3, b:2 at step 2"));
}

TEST(AttachAnswers, APushAheadCountsOnlyOnServersThisClientPushesTo) {
  const std::vector<v1::CreateJobResponse> answers = {At(3, 3), At(3, 4)};
  EXPECT_EQ(PushedAhead(answers, 3, {true, true}, {true, true}), 4u);
  EXPECT_EQ(PushedAhead(answers, 3, {true, true}, {true, false}), 0u);
  EXPECT_EQ(PushedAhead(answers, 3, {true, false}, {true, true}), 0u);
}

// The lrs a resuming trainer compares its own with: the step's, from a
// server that holds a part and is at that step; per group as sent, or the
// commit's lr for every group where it sent none; nothing for a skip, at
// step 0, or where no server says.
TEST(AttachAnswers, TheAppliedGroupLrsAreTheStepsFromAServerAtIt) {
  std::vector<v1::CreateJobResponse> answers = {At(3, 3, 0.25), At(3, 3, 0.25)};
  answers[0].add_applied_group_lr(0.5);  // two groups
  answers[1].add_applied_group_lr(0.5);
  EXPECT_THAT(AppliedGroupLr(answers, 3, {true, true}, 2), ElementsAre(0.25, 0.5));
  answers[0].set_applied_lr(9.0);  // not a part's server: not asked
  answers[0].clear_applied_group_lr();
  EXPECT_THAT(AppliedGroupLr(answers, 3, {false, true}, 2), ElementsAre(0.25, 0.5));
  EXPECT_THAT(AppliedGroupLr(answers, 3, {true, true}, 2), ElementsAre(9.0, 9.0));  // lr for every group
  EXPECT_THAT(AppliedGroupLr({At(2, 2), At(3, 3, 0.125)}, 3, {true, true}, 1), ElementsAre(0.125));
  answers[0].set_applied_skip(true);
  answers[1].set_applied_skip(true);
  EXPECT_TRUE(AppliedGroupLr(answers, 3, {true, true}, 2).empty());
  EXPECT_TRUE(AppliedGroupLr({At(0, 0, 0.0)}, 0, {true}, 1).empty());
  // A server (or a checkpoint) too old to say: its fields are 0.
  v1::CreateJobResponse old;
  old.set_step(3);
  EXPECT_TRUE(AppliedGroupLr({old}, 3, {true}, 2).empty());
}

TEST(AttachAnswers, ThisRanksOwnPushOfTheNextStepCountsSealedOrNot) {
  std::vector<v1::CreateJobResponse> answers = {At(3, 3), At(3, 3)};
  EXPECT_EQ(PushedAhead(answers, 3, {true, true}, {true, true}), 0u);
  answers[1].set_rank_pushed(true);
  EXPECT_EQ(PushedAhead(answers, 3, {true, true}, {true, true}), 4u);
  EXPECT_EQ(PushedAhead(answers, 3, {true, true}, {true, false}), 0u);
}

}  // namespace
}  // namespace shardopt
