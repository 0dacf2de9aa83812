#include "loadgen/workload.h"

#include <fstream>
#include <map>
#include <sstream>

#include <gtest/gtest.h>

#include "testing/temp_dir.h"

namespace kvtier::loadgen {
namespace {

int Words(const std::string& s) {
  std::istringstream in(s);
  std::string w;
  int n = 0;
  while (in >> w) ++n;
  return n;
}

// Records launches; answers only when told to.
class RecordingLauncher : public Launcher {
 public:
  struct Launch {
    double time;
    int user;
    int question;
    size_t messages;
  };
  void Launch(UserSession& s, int q) override {
    launches.push_back({now, s.user_id(), q, s.history().size()});
    pending.push_back(&s);
  }
  void AnswerAll(const std::string& text = "an answer") {
    for (auto* s : pending) s->OnAnswer(text);
    pending.clear();
  }
  double now = 0;
  std::vector<struct Launch> launches;
  std::vector<UserSession*> pending;
};

WorkloadConfig Config() {
  WorkloadConfig c;
  c.num_users = 4;
  c.num_rounds = 3;
  c.qps = 2;
  c.system_prompt_len = 50;
  c.user_history_len = 30;
  c.answer_len = 10;
  return c;
}

TEST(Prompts, AreBuiltFromWordsWithTheUserIdAndQuestionNumber) {
  EXPECT_EQ(FillerWords(3), "hi hi hi");
  EXPECT_EQ(FillerWords(0), "");
  auto c = Config();
  const std::string a = BuildContext(c, 7), b = BuildContext(c, 8);
  // The shared system part is identical for every user, so servers can share its KV cache.
  const std::string shared = "This is the shared system prompt for every user: " + FillerWords(50);
  EXPECT_EQ(a.rfind(shared, 0), 0u);
  EXPECT_EQ(b.rfind(shared, 0), 0u);
  // Then the user part, beginning with the user id.
  EXPECT_EQ(a.substr(shared.size(), 8), ". User 7");
  EXPECT_NE(a, b);
  EXPECT_GE(Words(a), 50 + 30);
  EXPECT_LE(Words(a), 50 + 30 + 20);
  EXPECT_EQ(BuildQuestion(3).rfind("Here's question #3: ", 0), 0u);
}

TEST(UserSession, ResendsTheWholeConversationEveryRound) {
  auto c = Config();
  UserSession s(c, 5);
  ASSERT_TRUE(s.ShouldSend(0, 2.0));
  EXPECT_EQ(s.StartRequest(0), 1);
  ASSERT_EQ(s.history().size(), 1u);
  EXPECT_NE(s.history()[0].content.find("User 5"), std::string::npos);
  EXPECT_NE(s.history()[0].content.find("Here's question #1:"), std::string::npos);
  s.OnAnswer("first answer");
  EXPECT_FALSE(s.ShouldSend(1.9, 2.0));  // not its turn yet
  ASSERT_TRUE(s.ShouldSend(2.0, 2.0));
  EXPECT_EQ(s.StartRequest(2.0), 2);
  ASSERT_EQ(s.history().size(), 3u);
  EXPECT_EQ(s.history()[1].role, "assistant");
  EXPECT_EQ(s.history()[1].content, "first answer");
  EXPECT_EQ(s.history()[2].content, BuildQuestion(2));  // later questions carry no context
  s.OnAnswer("second answer");
  EXPECT_EQ(s.StartRequest(4.0), 3);
  EXPECT_EQ(s.history().size(), 5u);
  EXPECT_FALSE(s.finished());
  s.OnAnswer("third");
  EXPECT_TRUE(s.finished());
  EXPECT_FALSE(s.ShouldSend(100, 2.0));
}

TEST(UserSession, NeverSendsWhileItsRequestIsUnansweredAndCountsTheLateTurn) {
  auto c = Config();
  UserSession s(c, 1);
  s.StartRequest(0);
  EXPECT_FALSE(s.ShouldSend(2.5, 2.0));
  EXPECT_FALSE(s.ShouldSend(3.0, 2.0));
  EXPECT_EQ(s.held_back(), 1);  // one late turn, however often it is checked
  s.OnAnswer("late");
  EXPECT_TRUE(s.ShouldSend(3.1, 2.0));
}

TEST(UserSession, AFailedQuestionIsAskedAgain) {
  auto c = Config();
  UserSession s(c, 1);
  s.StartRequest(0);
  s.OnAnswer("a");
  EXPECT_EQ(s.StartRequest(2), 2);
  s.OnFailure();
  EXPECT_EQ(s.history().size(), 2u);
  EXPECT_EQ(s.question_id(), 1);
  EXPECT_FALSE(s.in_flight());
  EXPECT_EQ(s.StartRequest(4), 2);
  EXPECT_EQ(s.history().back().content, BuildQuestion(2));
}

TEST(UserSession, ARefusedQuestionEndsTheConversation) {
  auto c = Config();
  UserSession s(c, 1);
  s.StartRequest(0);
  s.OnAnswer("a");
  s.StartRequest(2);
  s.OnRejected();
  EXPECT_FALSE(s.in_flight());
  EXPECT_TRUE(s.finished());
  EXPECT_TRUE(s.abandoned());
  EXPECT_FALSE(s.ShouldSend(100, 2.0));  // never asked again
}

TEST(Sharegpt, LoadsLmcachesFileAndAsksItsQuestions) {
  kvtier::testing::TempDir dir("sharegpt");
  // Three conversations: one too short for 2 rounds, one starting with the human, one (odd number
  // of turns) with the assistant.
  std::ofstream(dir.Sub("ShareGPT.json")) << R"([
    {"num_round": 2, "conversations": [{"value": "short", "num_tokens": 1},
                                       {"value": "a", "num_tokens": 1}]},
    {"num_round": 6, "conversations": [{"value": "q1", "num_tokens": 3}, {"value": "a1", "num_tokens": 7},
                                       {"value": "q2", "num_tokens": 2}, {"value": "a2", "num_tokens": 500},
                                       {"value": "q3", "num_tokens": 2}, {"value": "a3", "num_tokens": 1}]},
    {"num_round": 5, "conversations": [{"value": "hello", "num_tokens": 1},
                                       {"value": "Q1", "num_tokens": 3}, {"value": "A1", "num_tokens": 9},
                                       {"value": "Q2", "num_tokens": 2}, {"value": "A2", "num_tokens": 4}]}])";
  auto conversations = LoadSharegpt(dir.Sub("ShareGPT.json"), 2);
  ASSERT_TRUE(conversations.ok()) << conversations.status().ToString();
  ASSERT_EQ(conversations->size(), 2u);
  EXPECT_EQ((*conversations)[0].questions, (std::vector<std::string>{"q1", "q2"}));
  EXPECT_EQ((*conversations)[0].answer_tokens, (std::vector<int>{7, 500}));
  EXPECT_EQ((*conversations)[1].questions, (std::vector<std::string>{"Q1", "Q2"}));

  WorkloadConfig c = Config();
  c.num_rounds = 2;
  c.answer_len = 100;
  c.sharegpt = std::make_shared<const std::vector<SharegptConversation>>(*conversations);
  // User 2 gets conversation 0 (2 modulo 2), user 1 conversation 1.
  EXPECT_EQ(QuestionText(c, 2, 2), "q2");
  EXPECT_EQ(AnswerTokens(c, 2, 1), 7);
  EXPECT_EQ(AnswerTokens(c, 2, 2), 100);  // capped by --answer-len
  UserSession s(c, 1);
  s.StartRequest(0);
  EXPECT_EQ(s.history().back().content, BuildContext(c, 1) + "Q1");

  EXPECT_FALSE(LoadSharegpt(dir.Sub("ShareGPT.json"), 3).ok());  // nothing long enough
  EXPECT_FALSE(LoadSharegpt(dir.Sub("missing.json"), 2).ok());
  std::ofstream(dir.Sub("bad.json")) << R"({"not": "an array"})";
  EXPECT_EQ(LoadSharegpt(dir.Sub("bad.json"), 2).status().code(), StatusCode::kInvalidArgument);
}

TEST(SessionManager, StartsInSteadyStateAndKeepsAboutNumUsersActive) {
  auto c = Config();  // gap between a user's sends: 4 / 2 = 2 s; a new user every (3-1)/2 = 1 s
  EXPECT_DOUBLE_EQ(c.gap_between_requests(), 2.0);
  EXPECT_DOUBLE_EQ(c.gap_between_users(), 1.0);
  SessionManager m(c);
  RecordingLauncher l;
  const double t0 = 1000;
  l.now = t0;
  m.Step(t0, l);
  // num_users sessions spread over a session's life (offsets 4, 3, 2, 1 s -> questions 3, 2, 2, 1
  // already asked), the first of them already done, plus one user joining now.
  EXPECT_EQ(m.users_joined(), 5);
  EXPECT_EQ(m.active_users(), 4u);
  ASSERT_EQ(l.launches.size(), 1u);  // only the joining user sends at once
  EXPECT_EQ(l.launches[0].user, 5);
  EXPECT_EQ(l.launches[0].question, 1);

  // Simulate 200 s with instant answers, stepping every 10 ms.
  std::map<int, std::vector<double>> sends;
  size_t min_active = 100, max_active = 0;
  for (int i = 1; i <= 20000; ++i) {
    l.now = t0 + i * 0.01;
    m.Step(l.now, l);
    l.AnswerAll();
    min_active = std::min(min_active, m.active_users());
    max_active = std::max(max_active, m.active_users());
  }
  for (const auto& x : l.launches) sends[x.user].push_back(x.time);
  // Each user sends every 2 s (to the step), and never more than num_rounds questions.
  for (const auto& [user, times] : sends) {
    EXPECT_LE(times.size(), 3u) << user;
    for (size_t k = 1; k < times.size(); ++k) {
      EXPECT_NEAR(times[k] - times[k - 1], 2.0, 0.011) << "user " << user;
    }
  }
  EXPECT_GE(min_active, 3u);
  EXPECT_LE(max_active, 5u);
  // Sends per second: a user sends num_rounds questions over (num_rounds - 1) gaps, and users
  // join every (num_rounds - 1) / qps seconds: qps x num_rounds / (num_rounds - 1) = 3 per s.
  const double rate = static_cast<double>(l.launches.size()) / 200.0;
  EXPECT_NEAR(rate, 3.0, 0.1);
  EXPECT_DOUBLE_EQ(c.expected_qps(), 3.0);
  EXPECT_EQ(m.held_back(), 0);
}

TEST(SessionManager, SteadyStateSessionsResumeAtTheirQuestionNumber) {
  auto c = Config();
  SessionManager m(c);
  RecordingLauncher l;
  m.Step(0, l);
  std::map<int, int> first_question;
  for (int i = 1; i <= 400; ++i) {
    l.now = i * 0.01;
    m.Step(l.now, l);
    for (const auto& x : l.launches) first_question.emplace(x.user, x.question);
    l.AnswerAll();
  }
  // Users 2..4 were created mid-session: their first request is a later question, and it carries
  // the user's context (their conversation starts there).
  EXPECT_EQ(first_question[2], 3);
  EXPECT_EQ(first_question[3], 3);
  EXPECT_EQ(first_question[4], 2);
  EXPECT_EQ(first_question[5], 1);
  for (const auto& x : l.launches) {
    if (x.user == 2) {
      EXPECT_EQ(x.messages, 1u);
      break;
    }
  }
}

TEST(SessionManager, ClosedLoopKeepsEveryUserBusy) {
  auto c = Config();
  c.num_users = 6;
  SessionManager m(c, /*closed_loop=*/true);
  RecordingLauncher l;
  m.Step(0, l);
  EXPECT_EQ(l.launches.size(), 6u);
  EXPECT_EQ(m.requests_in_flight(), 6u);
  for (int i = 1; i <= 10; ++i) {
    l.AnswerAll();
    l.now = i * 0.001;
    m.Step(l.now, l);
    EXPECT_EQ(m.requests_in_flight(), 6u);  // finished users are replaced at once
  }
  EXPECT_EQ(l.launches.size(), 66u);
  EXPECT_GT(m.users_joined(), 6);
}

TEST(EstimatePromptTokens, GrowsByAnAnswerAndAQuestionEachRound) {
  auto c = Config();
  const int64_t r1 = EstimatePromptTokens(c, 1), r2 = EstimatePromptTokens(c, 2);
  EXPECT_GE(r1, c.system_prompt_len + c.user_history_len);
  EXPECT_GT(r2 - r1, c.answer_len);
  EXPECT_EQ(EstimatePromptTokens(c, 3) - r2, r2 - r1);
  EXPECT_EQ(EstimatePeakPromptTokens(c), EstimatePromptTokens(c, 3));
}

}  // namespace
}  // namespace kvtier::loadgen
