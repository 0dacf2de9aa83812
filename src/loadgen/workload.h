// The multi-round chat workload of LMCache's multi-round QA benchmark, as a clock-free state
// machine: the caller passes the time, so pacing is exact and testable without a server.
//
// Semantics (matching the LMCache benchmark so results compare with published ones):
//  * Each user has a conversation of `num_rounds` questions. The first user message holds a
//    shared system part (`system_prompt_len` filler words, identical for every user), then a
//    per-user part that begins with the user id (`user_history_len` filler words), then the
//    question "Here's question #N: ...". Every round appends the question and, once it has
//    streamed back, the answer; the whole conversation is re-sent every round.
//  * A user sends its next question `num_users / qps` seconds after its previous send, and never
//    while its previous request is unanswered (such a late send is counted as "held back").
//  * New users join every `(num_rounds - 1) / qps` seconds (a user lives `num_rounds - 1` gaps),
//    so about `num_users` are active at any time. The run starts in steady state: `num_users`
//    sessions are created at the first step as if already under way, spread evenly over a
//    session's life, with their question numbers advanced accordingly (their conversation text
//    starts at the current question, as in the LMCache benchmark).
//  * Closed-loop mode (the capacity probe) keeps exactly `num_users` users, each sending its next
//    question as soon as the previous answer arrives; a finished user is replaced at once.
//  * A failed request is taken back: the question leaves the history and is asked again at the
//    user's next turn. A rejected one (the server refused the request itself, e.g. a prompt over
//    its context window) ends the user's conversation instead: asking again would be refused
//    again, and every later round's prompt is longer.
//
// Thread-safety: none; drive a SessionManager from one thread.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvtier/status.h"

namespace kvtier::loadgen {

// One conversation of LMCache's ShareGPT file, as the benchmark uses it: the user's turns and
// the length of the answer that followed each (max_tokens, capped by answer_len).
struct SharegptConversation {
  std::vector<std::string> questions;
  std::vector<int> answer_tokens;  // same size as questions
};

struct WorkloadConfig {
  int num_users = 10;
  int num_rounds = 5;
  double qps = 0.5;
  int system_prompt_len = 1000;  // words (about tokens) shared by every user
  int user_history_len = 2000;   // words (about tokens) per user
  int answer_len = 100;          // max_tokens of every answer
  int init_user_id = 0;          // user ids start at init_user_id + 1
  // When set (--sharegpt): user u asks the questions of conversation u (modulo their number)
  // instead of the synthetic ones, each answer capped at that conversation's answer length.
  std::shared_ptr<const std::vector<SharegptConversation>> sharegpt;

  double gap_between_requests() const { return num_users / qps; }
  double gap_between_users() const { return (num_rounds > 1 ? num_rounds - 1 : 1) / qps; }
  // Requests per second this pacing sends when the server keeps up: a user asks num_rounds
  // questions over num_rounds - 1 gaps, so qps x R / (R - 1) (as in the LMCache benchmark).
  double expected_qps() const {
    return num_rounds > 1 ? qps * num_rounds / (num_rounds - 1) : qps;
  }
};

struct ChatMessage {
  std::string role;  // "user" or "assistant"
  std::string content;
};

// "hi hi hi ..." with `words` words.
std::string FillerWords(int words);
// The first part of every user's first message: shared system part, then the user part.
std::string BuildContext(const WorkloadConfig& config, int user_id);
std::string BuildQuestion(int question_id);
// The question text and max_tokens of a user's question `question_id` (1-based).
std::string QuestionText(const WorkloadConfig& config, int user_id, int question_id);
int AnswerTokens(const WorkloadConfig& config, int user_id, int question_id);

// Reads a ShareGPT file in LMCache's form (a JSON array of {"num_round": N, "conversations":
// [{"value": text, "num_tokens": n}, ...]}), keeping, as LMCache does, the conversations with
// more than 2 x num_rounds turns. A conversation with an odd number of turns starts with the
// assistant, whose first turn is skipped. InvalidArgument when the file is malformed or no
// conversation is long enough.
Result<std::vector<SharegptConversation>> LoadSharegpt(const std::string& path, int num_rounds);

// Estimated prompt tokens of a user's round `round` (1-based) when every answer had
// `answer_len` tokens: filler words count one token each, the fixed texts and the chat template
// a conservative allowance per message.
int64_t EstimatePromptTokens(const WorkloadConfig& config, int round);
// The peak: the last round's prompt.
inline int64_t EstimatePeakPromptTokens(const WorkloadConfig& config) {
  return EstimatePromptTokens(config, config.num_rounds);
}

class UserSession {
 public:
  UserSession(const WorkloadConfig& config, int user_id);

  int user_id() const { return user_id_; }
  int question_id() const { return question_id_; }  // questions asked so far (last one sent)
  bool in_flight() const { return in_flight_; }
  bool finished() const { return finished_; }
  std::optional<double> last_send() const { return last_send_; }
  const std::vector<ChatMessage>& history() const { return history_; }
  int held_back() const { return held_back_; }  // turns that came while a request was unanswered

  // Puts the session `offset` seconds into its life at time `now`, before its first send.
  void SetSteadyState(double offset, double now, double gap);
  // True when the session wants to send at `now` (it is not finished and its turn has come);
  // counts a held-back send when its turn has come but its previous request is unanswered.
  bool ShouldSend(double now, double gap);
  // Appends the next question and marks the request in flight. Returns its question number.
  int StartRequest(double now);
  void OnAnswer(const std::string& answer);
  void OnFailure();
  // The server refused the request: the conversation ends here (finished() and abandoned()).
  void OnRejected();
  bool abandoned() const { return abandoned_; }
  // Updates finished(): all rounds asked and answered.
  void UpdateFinished();

 private:
  const WorkloadConfig* config_;
  int user_id_;
  int question_id_ = 0;
  std::optional<double> last_send_;
  bool in_flight_ = false;
  bool finished_ = false;
  bool abandoned_ = false;
  bool late_ = false;  // the current turn has come while the previous request is unanswered
  int held_back_ = 0;
  std::vector<ChatMessage> history_;
};

// Sends requests on behalf of sessions; implemented over HTTP by the benchmark and by fakes in
// tests. The manager calls Launch after StartRequest; the launcher must later call the session's
// OnAnswer or OnFailure (from the same thread, outside Step).
class Launcher {
 public:
  virtual ~Launcher() = default;
  virtual void Launch(UserSession& session, int question_id) = 0;
};

class SessionManager {
 public:
  // `closed_loop`: the capacity probe's mode (see above).
  SessionManager(WorkloadConfig config, bool closed_loop = false);
  SessionManager(const SessionManager&) = delete;  // sessions point at config_
  SessionManager& operator=(const SessionManager&) = delete;

  // Joins users, lets every session that is due send, retires finished sessions.
  void Step(double now, Launcher& launcher);
  // The earliest time after `now` at which Step would do something (a send or a join), for the
  // caller's poll timeout; answers arriving earlier also make a step worthwhile.
  double NextEventTime(double now) const;

  const WorkloadConfig& config() const { return config_; }
  size_t active_users() const { return sessions_.size(); }
  int users_joined() const { return next_user_id_ - config_.init_user_id; }
  int64_t sends() const { return sends_; }
  int64_t held_back() const { return held_back_; }
  size_t requests_in_flight() const;
  const std::deque<std::unique_ptr<UserSession>>& sessions() const { return sessions_; }

 private:
  UserSession& AddUser();
  WorkloadConfig config_;
  bool closed_loop_;
  bool started_ = false;
  double last_join_ = 0;
  int next_user_id_;
  int64_t sends_ = 0;
  int64_t held_back_ = 0;
  // unique_ptr: a session's address must stay valid while its request is in flight.
  std::deque<std::unique_ptr<UserSession>> sessions_;
};

}  // namespace kvtier::loadgen
