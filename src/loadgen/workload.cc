#include "loadgen/workload.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <fstream>
#include <limits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kvtier::loadgen {
namespace {

// Allowances for the fixed texts, in tokens, generous for common tokenizers: the question
// sentence (~20 tokens), the headers of the context parts with the user id (~20), and the chat
// template's role markers per message (~8).
constexpr int64_t kQuestionTokens = 24;
constexpr int64_t kContextHeaderTokens = 24;
constexpr int64_t kTemplateTokensPerMessage = 8;

}  // namespace

std::string FillerWords(int words) {
  std::string out;
  out.reserve(static_cast<size_t>(std::max(words, 0)) * 3);
  for (int i = 0; i < words; ++i) {
    if (i > 0) out.push_back(' ');
    out += "hi";
  }
  return out;
}

std::string BuildContext(const WorkloadConfig& config, int user_id) {
  return fmt::format("This is the shared system prompt for every user: {}. User {} brings this "
                     "history of their own: {}. ",
                     FillerWords(config.system_prompt_len), user_id,
                     FillerWords(config.user_history_len));
}

std::string BuildQuestion(int question_id) {
  return fmt::format("Here's question #{}: please tell me a new long story with a happy ending.",
                     question_id);
}

namespace {

const SharegptConversation* ConversationOf(const WorkloadConfig& config, int user_id) {
  if (!config.sharegpt || config.sharegpt->empty()) return nullptr;
  const auto n = static_cast<int64_t>(config.sharegpt->size());
  return &(*config.sharegpt)[static_cast<size_t>(((user_id % n) + n) % n)];
}

}  // namespace

std::string QuestionText(const WorkloadConfig& config, int user_id, int question_id) {
  const SharegptConversation* c = ConversationOf(config, user_id);
  if (c == nullptr || c->questions.empty()) return BuildQuestion(question_id);
  return c->questions[static_cast<size_t>(question_id - 1) % c->questions.size()];
}

int AnswerTokens(const WorkloadConfig& config, int user_id, int question_id) {
  const SharegptConversation* c = ConversationOf(config, user_id);
  if (c == nullptr || c->answer_tokens.empty()) return config.answer_len;
  const int n = c->answer_tokens[static_cast<size_t>(question_id - 1) % c->answer_tokens.size()];
  return std::clamp(n, 1, config.answer_len);
}

Result<std::vector<SharegptConversation>> LoadSharegpt(const std::string& path, int num_rounds) {
  std::ifstream in(path);
  if (!in) return Status::FromErrno(errno, fmt::format("opening the ShareGPT file {}", path));
  auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_array()) {
    return Status::InvalidArgument(fmt::format("{} is not a JSON array of conversations", path));
  }
  std::vector<SharegptConversation> out;
  for (const auto& d : j) {
    if (!d.is_object() || !d.contains("conversations") || !d["conversations"].is_array()) {
      return Status::InvalidArgument(
          fmt::format("{}: an entry without a \"conversations\" array", path));
    }
    const auto& turns = d["conversations"];
    const int64_t num_round = d.value("num_round", static_cast<int64_t>(turns.size()));
    if (num_round <= 2 * static_cast<int64_t>(num_rounds)) continue;
    SharegptConversation c;
    const size_t first = num_round % 2 == 0 ? 0 : 1;  // odd: the assistant speaks first
    for (size_t t = first; t + 1 < turns.size() && c.questions.size() < static_cast<size_t>(num_rounds); t += 2) {
      const auto& q = turns[t];
      const auto& a = turns[t + 1];
      if (!q.is_object() || !q.contains("value") || !q["value"].is_string()) {
        return Status::InvalidArgument(fmt::format("{}: a turn without a \"value\" text", path));
      }
      c.questions.push_back(q["value"].get<std::string>());
      c.answer_tokens.push_back(a.is_object() && a.contains("num_tokens") && a["num_tokens"].is_number_integer()
                                    ? a["num_tokens"].get<int>()
                                    : std::numeric_limits<int>::max());
    }
    if (static_cast<int>(c.questions.size()) == num_rounds) out.push_back(std::move(c));
  }
  if (out.empty()) {
    return Status::InvalidArgument(fmt::format(
        "{} holds no conversation with more than {} turns (2 x --num-rounds)", path, 2 * num_rounds));
  }
  return out;
}

int64_t EstimatePromptTokens(const WorkloadConfig& config, int round) {
  round = std::max(round, 1);
  const int64_t messages = 2 * static_cast<int64_t>(round) - 1;
  return config.system_prompt_len + config.user_history_len + kContextHeaderTokens +
         round * kQuestionTokens + static_cast<int64_t>(round - 1) * config.answer_len +
         messages * kTemplateTokensPerMessage;
}

UserSession::UserSession(const WorkloadConfig& config, int user_id)
    : config_(&config), user_id_(user_id) {}

void UserSession::SetSteadyState(double offset, double now, double gap) {
  // Questions already "asked" in the part of the session before `now`.
  const int passed = static_cast<int>(offset / gap) + 1;
  question_id_ = passed;
  last_send_ = now - offset + (passed - 1) * gap;
}

bool UserSession::ShouldSend(double now, double gap) {
  if (finished_) return false;
  if (question_id_ >= config_->num_rounds && !in_flight_) return false;
  if (!last_send_) return !in_flight_;
  if (now - *last_send_ < gap) return false;
  if (in_flight_) {
    if (!late_) ++held_back_;
    late_ = true;
    return false;
  }
  return question_id_ < config_->num_rounds;
}

int UserSession::StartRequest(double now) {
  ++question_id_;
  std::string text = QuestionText(*config_, user_id_, question_id_);
  if (history_.empty()) text = BuildContext(*config_, user_id_) + text;
  history_.push_back({"user", std::move(text)});
  in_flight_ = true;
  late_ = false;
  last_send_ = now;
  return question_id_;
}

void UserSession::OnAnswer(const std::string& answer) {
  history_.push_back({"assistant", answer});
  in_flight_ = false;
  UpdateFinished();
}

void UserSession::OnFailure() {
  // Take the question back; it is asked again at the next turn.
  if (!history_.empty() && history_.back().role == "user") history_.pop_back();
  --question_id_;
  in_flight_ = false;
}

void UserSession::OnRejected() {
  in_flight_ = false;
  abandoned_ = true;
  finished_ = true;
}

void UserSession::UpdateFinished() {
  if (question_id_ >= config_->num_rounds && !in_flight_) finished_ = true;
}

SessionManager::SessionManager(WorkloadConfig config, bool closed_loop)
    : config_(config), closed_loop_(closed_loop), next_user_id_(config.init_user_id) {}

UserSession& SessionManager::AddUser() {
  ++next_user_id_;
  sessions_.push_back(std::make_unique<UserSession>(config_, next_user_id_));
  return *sessions_.back();
}

void SessionManager::Step(double now, Launcher& launcher) {
  const double gap = closed_loop_ ? 0.0 : config_.gap_between_requests();
  if (!started_) {
    started_ = true;
    if (closed_loop_) {
      for (int i = 0; i < config_.num_users; ++i) AddUser();
    } else {
      // Steady state: sessions spread evenly over one session's life.
      const double life = config_.gap_between_users() * config_.num_users;
      for (int i = 0; i < config_.num_users; ++i) {
        const double offset = life - i * config_.gap_between_users();
        AddUser().SetSteadyState(offset, now, gap);
      }
      AddUser();  // and one joining now
    }
    last_join_ = now;
  } else if (!closed_loop_ && now - last_join_ >= config_.gap_between_users()) {
    AddUser();
    last_join_ = now;
  }

  for (auto& s : sessions_) {
    s->UpdateFinished();
    const int held_before = s->held_back();
    if (s->ShouldSend(now, gap)) {
      const int q = s->StartRequest(now);
      ++sends_;
      launcher.Launch(*s, q);
    }
    held_back_ += s->held_back() - held_before;
  }
  // Retire finished sessions; keep the closed loop full.
  size_t before = sessions_.size();
  sessions_.erase(std::remove_if(sessions_.begin(), sessions_.end(),
                                 [](const auto& s) {
                                   s->UpdateFinished();
                                   return s->finished();
                                 }),
                  sessions_.end());
  if (closed_loop_) {
    for (size_t i = sessions_.size(); i < before; ++i) {
      UserSession& fresh = AddUser();
      const int q = fresh.StartRequest(now);
      ++sends_;
      launcher.Launch(fresh, q);
    }
  }
}

double SessionManager::NextEventTime(double now) const {
  double next = std::numeric_limits<double>::infinity();
  if (!started_) return now;
  if (!closed_loop_) next = last_join_ + config_.gap_between_users();
  const double gap = closed_loop_ ? 0.0 : config_.gap_between_requests();
  for (const auto& s : sessions_) {
    if (s->in_flight() || s->finished()) continue;  // wakes up on its answer
    if (!s->last_send()) return now;
    next = std::min(next, *s->last_send() + gap);
  }
  return std::max(next, now);
}

size_t SessionManager::requests_in_flight() const {
  size_t n = 0;
  for (const auto& s : sessions_) n += s->in_flight() ? 1 : 0;
  return n;
}

}  // namespace kvtier::loadgen
