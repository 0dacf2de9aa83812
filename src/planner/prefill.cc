#include "planner/prefill.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace kvtier::planner {

Result<PrefillCost> PrefillCost::FromTable(std::vector<std::pair<uint64_t, double>> points) {
  if (points.empty()) return Status::InvalidArgument("prefill table is empty");
  std::sort(points.begin(), points.end());
  for (size_t i = 0; i < points.size(); ++i) {
    const auto& [tokens, seconds] = points[i];
    if (tokens == 0 || !(seconds > 0)) {
      return Status::InvalidArgument(fmt::format(
          "prefill table entry {}:{} needs tokens > 0 and seconds > 0", tokens, seconds));
    }
    if (i > 0 && tokens == points[i - 1].first) {
      return Status::InvalidArgument(fmt::format("prefill table lists {} tokens twice", tokens));
    }
    if (i > 0 && seconds < points[i - 1].second) {
      return Status::InvalidArgument(
          fmt::format("prefill table is not monotone: {} tokens take {} s but {} tokens take {} s",
                      tokens, seconds, points[i - 1].first, points[i - 1].second));
    }
  }
  PrefillCost c;
  c.table_ = points;
  // Least squares of t = b*L + c*L^2 (no intercept: fixed overheads belong to the step model).
  double s22 = 0, s23 = 0, s33 = 0, s2t = 0, s3t = 0;
  for (const auto& [tokens, seconds] : points) {
    double l = static_cast<double>(tokens);
    s22 += l * l;
    s23 += l * l * l;
    s33 += l * l * l * l;
    s2t += l * seconds;
    s3t += l * l * seconds;
  }
  double det = s22 * s33 - s23 * s23;
  if (points.size() >= 2 && std::abs(det) > 1e-30 * s22 * s33) {
    c.fit_linear_ = (s2t * s33 - s3t * s23) / det;
    c.fit_quadratic_ = (s22 * s3t - s23 * s2t) / det;
  }
  if (points.size() < 2 || c.fit_quadratic_ < 0 || c.fit_linear_ < 0) {
    // One point, or a table that is concave: extrapolate linearly through the origin and the
    // last point rather than with a fit that would bend downwards.
    c.fit_quadratic_ = 0;
    c.fit_linear_ = points.back().second / static_cast<double>(points.back().first);
  }
  c.description_ = fmt::format("table of {} measured points up to {} tokens", points.size(),
                               points.back().first);
  return c;
}

Result<PrefillCost> PrefillCost::FromFlops(const ModelSpec& model, double peak_flops_per_gpu,
                                           double efficiency) {
  if (!(peak_flops_per_gpu > 0)) return Status::InvalidArgument("peak FLOP/s must be > 0");
  if (!(efficiency > 0) || efficiency > 1) {
    return Status::InvalidArgument(
        fmt::format("prefill efficiency {} must be in (0, 1]", efficiency));
  }
  PrefillCost c;
  c.flops_linear_ = 2.0 * model.active_params;
  c.flops_quadratic_ =
      2.0 * model.attention_heads * (model.qk_head_dim + model.v_head_dim) * model.num_layers;
  c.flops_per_s_ = peak_flops_per_gpu * model.tensor_parallel * efficiency;
  c.description_ = fmt::format("FLOPs at {:.0f}% of {:.0f} TFLOP/s x {} GPU(s)", efficiency * 100,
                               peak_flops_per_gpu / 1e12, model.tensor_parallel);
  return c;
}

double PrefillCost::CachedAttention(uint64_t cached, uint64_t new_tokens) const {
  const double m = static_cast<double>(cached);
  const double n = static_cast<double>(new_tokens);
  // F(m+n) - F(m) - F(n) of the quadratic part: c*((m+n)^2 - m^2 - n^2) = 2cmn, and for the
  // FLOP model's L*(L+1)/2 causal pairs, m*n pairs.
  if (table_.empty()) return flops_quadratic_ * m * n / flops_per_s_;
  return 2 * fit_quadratic_ * m * n;
}

double PrefillCost::Cumulative(uint64_t tokens) const {
  const double l = static_cast<double>(tokens);
  if (table_.empty()) {
    // Causal attention over L tokens: L*(L+1)/2 query-key pairs.
    return (flops_linear_ * l + flops_quadratic_ * l * (l + 1) / 2) / flops_per_s_;
  }
  if (tokens == 0) return 0;
  const auto& last = table_.back();
  if (tokens >= last.first) {
    const double x = static_cast<double>(last.first);
    auto fit = [&](double v) { return fit_linear_ * v + fit_quadratic_ * v * v; };
    return last.second + fit(l) - fit(x);
  }
  uint64_t x0 = 0;
  double y0 = 0;
  for (const auto& [x1, y1] : table_) {
    if (tokens <= x1) {
      return y0 + (y1 - y0) * (l - static_cast<double>(x0)) / static_cast<double>(x1 - x0);
    }
    x0 = x1;
    y0 = y1;
  }
  return last.second;  // unreachable
}

}  // namespace kvtier::planner
