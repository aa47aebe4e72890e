// Suffix drafts for speculative decoding in C++: `rollout.sampling.drafts` (its SuffixIndex, `walk` and the lookup
// of `Drafter.draft`) step for step, so the same drafts and the same estimates, bit for bit (each estimate is the
// same double arithmetic in the same order). The Python module is the reference and the fallback; this one only
// takes the host's time out of a speculative step (a 4-row 5M tail drafted ~30 us a call in Python).
//
// An index holds a copy of its source's tokens (`pull`: the new ones since the last call, read from its list), the
// 2-grams followed by a token (`has_pair`, built lazily as in Python, in a flat set) and, for every n-gram (n = 1 ..
// max_n) of the tokens, the positions that followed it (`Chains`: a hash chain a position, no allocation a token),
// read as Python's lists hold them: the latest POSITIONS, trimmed from 2 x POSITIONS. (The maps of n-grams to vectors
// this replaced spent ~100 us of a 27-row 5M log-normal step indexing its new tokens, ~2/3 of its lookups' time. On 32
// rows of 150-450 tokens, a token appended to each a call, caches flushed between calls: `suffix_drafts` 114-150 ->
// 60-71 us, `any_pairs` 61-71 -> 29-35 us, benchmarks/logs/speculation_tail/draft_lookups_micro_fifteenth_session.txt.)

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "kernels.h"

namespace {

constexpr int MAX_NGRAM = 8;       // rollout.sampling.drafts.MAX_NGRAM
constexpr int64_t MIN_NGRAM = 2;   // rollout.sampling.drafts.MIN_NGRAM
constexpr size_t POSITIONS = 32;   // rollout.sampling.drafts.POSITIONS
constexpr double SMOOTHING = 1.0;  // rollout.sampling.drafts.SMOOTHING
constexpr double CALIBRATION_DECAY = 0.7;  // rollout.engine.speculation.CALIBRATION_DECAY

struct Gram {
  std::array<int64_t, MAX_NGRAM> t{};
  bool operator==(const Gram& o) const { return t == o.t; }
};

struct GramHash {
  size_t operator()(const Gram& g) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : g.t) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h ^ (h >> 29));
  }
};

// the 2-grams followed by a token, as a flat open-addressing set (no allocation an insert)
struct PairSet {
  static constexpr int64_t EMPTY = std::numeric_limits<int64_t>::min();  // NOTE: no token id
  std::vector<std::array<int64_t, 2>> slots;
  size_t used = 0;

  static size_t hash(int64_t a, int64_t b) {
    const uint64_t h = (static_cast<uint64_t>(a) * 0x9E3779B97F4A7C15ull) ^ static_cast<uint64_t>(b);
    return static_cast<size_t>((h ^ (h >> 32)) * 0xD6E8FEB86659FD93ull >> 7);
  }

  bool contains(int64_t a, int64_t b) const {
    if (slots.empty()) return false;
    const size_t mask = slots.size() - 1;
    for (size_t i = hash(a, b) & mask;; i = (i + 1) & mask) {
      const auto& s = slots[i];
      if (s[0] == EMPTY) return false;
      if (s[0] == a && s[1] == b) return true;
    }
  }

  void insert(int64_t a, int64_t b) {
    if (2 * (used + 1) > slots.size()) {
      std::vector<std::array<int64_t, 2>> old(std::max<size_t>(64, slots.size() * 2), {EMPTY, 0});
      old.swap(slots);
      used = 0;
      for (const auto& s : old)
        if (s[0] != EMPTY) insert(s[0], s[1]);
    }
    const size_t mask = slots.size() - 1;
    for (size_t i = hash(a, b) & mask;; i = (i + 1) & mask) {
      auto& s = slots[i];
      if (s[0] == EMPTY) {
        s = {a, b};
        ++used;
        return;
      }
      if (s[0] == a && s[1] == b) return;
    }
  }
};

// One n's occurrences: for every n-gram of the tokens, its latest position (the position following it) and how
// many there were, in a flat open-addressing table keyed by the n-gram's hash (the n-gram itself compared on a match:
// it is read off the tokens before the entry's latest position), and for every position the previous one whose n
// tokens before it are the same n-gram (`prev`, -1: none): a hash chain, as an LZ77 match finder keeps. Indexing a
// position is a probe and two stores, no allocation; the positions of an n-gram are its chain from the latest.
struct Chains {
  struct Entry {
    uint64_t hash;
    int64_t latest;  // -1: an empty slot
    int64_t count;
  };
  std::vector<Entry> table;
  std::vector<int64_t> prev;
  size_t used = 0;

  // the entry of the n-gram ending before `gram_end` (n tokens), read in `tokens`; nullptr when absent
  const Entry* lookup(const std::vector<int64_t>& tokens, const int64_t* gram_end, int64_t n, uint64_t hash) const {
    if (table.empty()) return nullptr;
    const size_t mask = table.size() - 1;
    for (size_t i = hash & mask;; i = (i + 1) & mask) {
      const Entry& e = table[i];
      if (e.latest < 0) return nullptr;
      if (e.hash == hash && std::equal(gram_end - n, gram_end, tokens.data() + e.latest - n)) return &e;
    }
  }

  void grow() {
    std::vector<Entry> old(std::max<size_t>(64, table.size() * 2), Entry{0, -1, 0});
    old.swap(table);
    const size_t mask = table.size() - 1;
    for (const Entry& e : old) {
      if (e.latest < 0) continue;
      size_t i = e.hash & mask;
      while (table[i].latest >= 0) i = (i + 1) & mask;
      table[i] = e;
    }
  }

  // position p follows the n-gram tokens[p - n : p] (its hash given)
  void add(const std::vector<int64_t>& tokens, int64_t p, int64_t n, uint64_t hash) {
    if (2 * (used + 1) > table.size()) grow();
    const size_t at = static_cast<size_t>(p);
    if (prev.size() <= at) prev.resize(std::max<size_t>(at + 1, 2 * prev.size()), -1);
    const size_t mask = table.size() - 1;
    const int64_t* gram_end = tokens.data() + p;
    for (size_t i = hash & mask;; i = (i + 1) & mask) {
      Entry& e = table[i];
      if (e.latest < 0) {
        e = Entry{hash, p, 1};
        prev[p] = -1;
        ++used;
        return;
      }
      if (e.hash == hash && std::equal(gram_end - n, gram_end, tokens.data() + e.latest - n)) {
        prev[p] = e.latest;
        e.latest = p;
        ++e.count;
        return;
      }
    }
  }
};

// the hash of the n-gram ending before `end` grown by one token (its n-th from the end, `token`): the n-gram read
// from its last token back, as the chains are built and looked up
inline uint64_t grow_hash(uint64_t h, int64_t token) {
  h ^= static_cast<uint64_t>(token) + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return h * 0xBF58476D1CE4E5B9ull;
}

constexpr uint64_t HASH_SEED = 0x243F6A8885A308D3ull;

// the calls of `suffix_drafts` and `any_pairs` so far (under the GIL): an index pulled in this one is not pulled again
uint64_t epoch = 0;

// how many of an n-gram's `count` occurrences Python's list holds: it grows to 2 x POSITIONS, then keeps the latest
// POSITIONS (appended, then trimmed: `SuffixIndex.update`)
inline int64_t visible(int64_t count) {
  const int64_t P = static_cast<int64_t>(POSITIONS);
  return count <= 2 * P ? count : P + (count - 2 * P - 1) % (P + 1);
}

}  // namespace

struct SuffixIndexNative {
  explicit SuffixIndexNative(int64_t max_n) : max_n(max_n), chains(static_cast<size_t>(max_n)) {
    TORCH_CHECK(max_n >= 1 && max_n <= MAX_NGRAM, "SuffixIndexNative: max_n in 1..", MAX_NGRAM);
  }

  int64_t max_n;
  std::vector<int64_t> tokens;
  std::vector<Chains> chains;  // n-1 -> the occurrences of the n-grams
  int64_t upto = 1;  // next position whose preceding n-grams are not indexed yet
  PairSet pairs;
  int64_t pairs_upto = 2;

  int64_t size() const { return static_cast<int64_t>(tokens.size()); }

  // the Python list this index copies (`bind`: a request's `token_ids`, read at each `pull`), and the other indexes
  // its row's lookups read (`set_sources`: its live siblings' and its prompt's finished rollouts'; raw pointers, kept
  // alive by the Python side, `NativeIndex.sources`: no reference from here, so no cycle the collector cannot see)
  pybind11::object source;
  std::vector<SuffixIndexNative*> others;
  uint64_t pulled = 0;  // the call (`epoch`) that last pulled it: a sibling is a source of every row of its group

  // its row's planning state (`plan_drafts`, `rollout.engine.speculation.Speculator` on these indexes): the most tokens
  // a draft (its k, at most MAX_DRAFT: `configure`), the position past which it must not draft (prompt + forced +
  // max_new_tokens - 1), its longest suffix matched; its calibration (`Calibration`: its verified drafts' estimates and
  // kept tokens, decayed); its idle spell (looked up again at step `idle_until`; `spell` 0: none); the estimates of the
  // draft it proposed last (`record`)
  int64_t kcap = 0, last = 0, ngram = 4;
  double cal_est = 0.0, cal_kept = 0.0;
  int64_t idle_until = 0, spell = 0;
  std::vector<double> proposed;

  void configure(int64_t k, int64_t end, int64_t n) {
    TORCH_CHECK(n >= 1 && n <= max_n, "SuffixIndexNative.configure: ngram in 1..", max_n);
    kcap = k;
    last = end;
    ngram = n;
  }

  double scale() const { return std::min(2.0, (cal_kept + 1) / (cal_est + 1)); }

  // `Calibration.record` of the first `drafted` tokens of its last proposed draft, `kept` of them kept
  void record(int64_t drafted, int64_t kept) {
    TORCH_CHECK(drafted >= 0 && drafted <= static_cast<int64_t>(proposed.size()),
                "SuffixIndexNative.record: more tokens verified than proposed");
    double est = 0.0;
    for (int64_t i = 0; i < drafted; ++i) est += proposed[static_cast<size_t>(i)];
    cal_est = CALIBRATION_DECAY * cal_est + est;
    cal_kept = CALIBRATION_DECAY * cal_kept + static_cast<double>(kept);
  }

  void bind(pybind11::list list) { source = std::move(list); }

  // its list's tokens are final (a finished rollout): copied now, never read again
  void freeze() {
    pull();
    source = pybind11::object();
  }

  void set_sources(const std::vector<SuffixIndexNative*>& indexes) { others = indexes; }

  // the bound list's tokens from the last one copied on, read under the GIL (the last one copied may have changed: a
  // placeholder written over; an indexed n-gram or pair never holds a source's last token, so the index stays exact)
  void pull() {
    if (!source) return;
    PyObject* list = source.ptr();
    const int64_t n = static_cast<int64_t>(PyList_GET_SIZE(list));
    const int64_t start = std::max<int64_t>(0, std::min(size(), n) - 1);
    TORCH_CHECK(start >= std::max<int64_t>(0, std::min(upto, pairs_upto) - 1),
                "SuffixIndexNative.pull: the bound list lost tokens already indexed");
    tokens.resize(static_cast<size_t>(start));
    for (int64_t i = start; i < n; ++i) {
      const long long v = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
      if (v == -1 && PyErr_Occurred()) throw pybind11::error_already_set();
      tokens.push_back(v);
    }
  }

  // this row's index and its sources' brought up to date, each once in a call (`call`, of `epoch`: the Python lists
  // do not change during one)
  void pull_with_sources(uint64_t call) {
    if (pulled != call) {
      pull();
      pulled = call;
    }
    for (auto* o : others) {
      if (o->pulled != call) {
        o->pull();
        o->pulled = call;
      }
    }
  }

  // whether this row's last 2 tokens were followed by a token in its own text or a source's: every suffix of 2+
  // tokens ends with them, so where they were not, nothing drafts
  bool last_pair_occurs() {
    const int64_t len = size();
    if (len < 2) return false;
    const int64_t a = tokens[len - 2], b = tokens[len - 1];
    if (has_pair(a, b)) return true;
    for (auto* o : others)
      if (o->has_pair(a, b)) return true;
    return false;
  }

  void update() {
    const int64_t len = size();
    for (int64_t p = upto; p < len; ++p) {
      uint64_t h = HASH_SEED;
      for (int64_t n = 1; n <= std::min(max_n, p); ++n) {
        h = grow_hash(h, tokens[p - n]);
        chains[n - 1].add(tokens, p, n, h);
      }
    }
    upto = std::max(upto, len);
  }

  bool has_pair(int64_t a, int64_t b) {
    const int64_t len = size();
    for (int64_t p = pairs_upto; p < len; ++p) pairs.insert(tokens[p - 2], tokens[p - 1]);
    pairs_upto = std::max(pairs_upto, len);
    return pairs.contains(a, b);
  }

  // the positions following the n tokens before `gram_end` (their hash given), ascending, into `out` (the latest
  // `visible(count)` of them, as Python's list holds them); false when none
  bool find(const int64_t* gram_end, int64_t n, uint64_t hash, std::vector<int64_t>& out) const {
    const Chains& c = chains[n - 1];
    const auto* e = c.lookup(tokens, gram_end, n, hash);
    if (e == nullptr) return false;
    const int64_t m = visible(e->count);
    out.resize(static_cast<size_t>(m));
    int64_t p = e->latest;
    for (int64_t i = m - 1; i >= 0; --i) {
      out[static_cast<size_t>(i)] = p;
      p = c.prev[static_cast<size_t>(p)];
    }
    return true;
  }
};

namespace {

struct Source {
  const std::vector<int64_t>* tokens;
  const std::vector<int64_t>* positions;
};

struct Path {
  int64_t src, p, len;  // the continuation: tokens[p : p + len] of source src
  bool loops;           // the row's own, cut by its end: goes on with the draft
  int64_t count;
};

// `rollout.sampling.drafts.walk`; sources[0] is the row's own (periodic)
std::tuple<std::vector<int64_t>, std::vector<double>> walk(const std::vector<Source>& sources, int64_t k,
                                                           double min_prob) {
  std::vector<Path> paths;
  std::unordered_map<Gram, std::vector<size_t>, GramHash> seen;  // NOTE: a hash of the first tokens -> candidates
  int64_t total = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    const auto& toks = *sources[i].tokens;
    const auto& ps = *sources[i].positions;
    const int64_t end = static_cast<int64_t>(toks.size());
    for (auto it = ps.rbegin(); it != ps.rend(); ++it) {
      const int64_t p = *it, len = std::max<int64_t>(0, std::min(k, end - p));
      const bool loops = i == 0 && p + k > end;
      Gram key;  // NOTE: the first MAX_NGRAM - 1 tokens, the length and the flag: candidates, then compared whole
      for (int64_t j = 0; j < std::min<int64_t>(len, MAX_NGRAM - 1); ++j) key.t[j] = toks[p + j];
      key.t[MAX_NGRAM - 1] = len * 2 + (loops ? 1 : 0);
      auto& cands = seen[key];
      bool found = false;
      for (size_t c : cands) {
        Path& q = paths[c];
        const auto& qt = *sources[q.src].tokens;
        if (q.len == len && q.loops == loops &&
            std::equal(qt.begin() + q.p, qt.begin() + q.p + len, toks.begin() + p)) {
          ++q.count;
          found = true;
          break;
        }
      }
      if (!found) {
        cands.push_back(paths.size());
        paths.push_back({static_cast<int64_t>(i), p, len, loops, 1});
      }
    }
    total += static_cast<int64_t>(ps.size());
  }
  std::vector<size_t> live(paths.size());
  for (size_t i = 0; i < live.size(); ++i) live[i] = i;
  std::vector<int64_t> draft;
  std::vector<double> probs;
  int64_t on = total;
  double prob = 1.0;
  std::vector<std::pair<int64_t, int64_t>> counts;  // NOTE: (token, count) in the order first seen
  std::vector<std::pair<size_t, int64_t>> step;     // NOTE: (path, its token at this depth)
  for (int64_t d = 0; d < k; ++d) {
    counts.clear();
    step.clear();
    for (size_t li : live) {
      const Path& q = paths[li];
      int64_t t;
      if (d < q.len) t = (*sources[q.src].tokens)[q.p + d];
      else if (q.loops) t = draft[d - q.len];
      else continue;
      auto c = std::find_if(counts.begin(), counts.end(), [t](const auto& x) { return x.first == t; });
      if (c == counts.end()) counts.emplace_back(t, q.count);
      else c->second += q.count;
      step.emplace_back(li, t);
    }
    if (counts.empty()) break;
    auto best = counts.begin();  // NOTE: the first of the most frequent, as Python's max over an insertion-ordered dict
    for (auto c = counts.begin(); c != counts.end(); ++c)
      if (c->second > best->second) best = c;
    prob *= static_cast<double>(best->second) / (static_cast<double>(on) + SMOOTHING);
    on = best->second;
    if (prob < min_prob) break;
    draft.push_back(best->first);
    probs.push_back(prob);
    live.clear();
    for (const auto& [li, t] : step)
      if (t == best->first) live.push_back(li);
  }
  return {draft, probs};
}

}  // namespace

// One row's `Drafter.draft` over its sources (`set_sources`): the pair check, every index brought up to date, the
// longest suffix (max_n .. shortest tokens) found in the row's own index or another's, and the walk
std::tuple<std::vector<int64_t>, std::vector<double>> suffix_draft(SuffixIndexNative& own, int64_t k, int64_t max_n,
                                                                   int64_t shortest, double min_prob) {
  const auto& toks = own.tokens;
  const auto& others = own.others;
  const int64_t len = own.size();
  if (shortest >= 2 && !own.last_pair_occurs()) return {};
  own.update();
  for (auto* o : others) o->update();
  // NOTE: the positions found, a buffer a source (the row's own first), kept between calls: no allocation a lookup
  thread_local std::vector<std::vector<int64_t>> found;
  if (found.size() < others.size() + 1) found.resize(others.size() + 1);
  std::vector<Source> sources;
  const int64_t* gram_end = toks.data() + len;
  uint64_t hashes[MAX_NGRAM + 1];  // NOTE: the suffix's hash for each n, built from its last token back
  const int64_t top = std::min({max_n, own.max_n, len});
  hashes[0] = HASH_SEED;
  for (int64_t n = 1; n <= top; ++n) hashes[n] = grow_hash(hashes[n - 1], gram_end[-n]);
  for (int64_t n = top; n >= shortest && n >= 1; --n) {
    const bool mine = own.find(gram_end, n, hashes[n], found[0]);
    if (!mine) found[0].clear();
    sources.clear();
    sources.push_back({&toks, &found[0]});
    size_t used = 1;
    for (auto* o : others) {
      if (n > o->max_n) continue;
      if (o->find(gram_end, n, hashes[n], found[used])) {
        sources.push_back({&o->tokens, &found[used]});
        ++used;
      }
    }
    if (mine || sources.size() > 1) return walk(sources, k, min_prob);
  }
  return {};
}

// `Drafter.draft_many`: every row of a step in one call -- each row's own index and its sources brought up to date
// from their bound lists (`pull`), then `suffix_draft` from max_n down to min(MIN_NGRAM, max_n) tokens -- instead of
// a sync, a slice and a lookup call a row in Python (a 4-row step of text that never repeats spent ~6 us a row there,
// 0.4 us of it here)
std::vector<std::tuple<std::vector<int64_t>, std::vector<double>>> suffix_drafts(
    const std::vector<SuffixIndexNative*>& owns, const std::vector<int64_t>& ks, const std::vector<int64_t>& max_ns,
    const std::vector<double>& min_probs) {
  const size_t R = owns.size();
  TORCH_CHECK(ks.size() == R && max_ns.size() == R && min_probs.size() == R,
              "suffix_drafts: a k, max_n and min_prob per row");
  std::vector<std::tuple<std::vector<int64_t>, std::vector<double>>> out;
  out.reserve(R);
  const uint64_t call = ++epoch;
  for (size_t r = 0; r < R; ++r) {
    owns[r]->pull_with_sources(call);
    out.push_back(suffix_draft(*owns[r], ks[r], max_ns[r], std::min(MIN_NGRAM, max_ns[r]), min_probs[r]));
  }
  return out;
}

// `Speculator.plan` past its gates, in one call (its Python, `Speculator._drafts` and `StepCost.plan`, is the
// reference: the same drafts, tests/engine/test_speculation.py). Each row not in an idle spell (`spells`: a step of
// more than LOOKUP_ROWS rows) is looked up with k = min(kcap, last - its length) and min_prob `floor` / its scale, its
// estimates scaled (at most 1), an idle spell begun or doubled (at most `spell_cap`) where it found nothing. Then,
// unless `every` (each draft whole), the likeliest drafted tokens (at most `room` of them, unless negative) that
// maximise the expected tokens a unit of time (`c0` a step, `dx` more a drafted token) over the plain step's rows.
// None when nothing is worth verifying, else each row's draft. (Steps of more than 16 rows of the log-normal G=8
// batch: their planning ~125-235 -> ~80-150 us, benchmarks/logs/speculation_tail/ab_sixteenth_session.txt.)
pybind11::object plan_drafts(const std::vector<SuffixIndexNative*>& owns, double floor, double c0, double dx,
                             int64_t room, int64_t step, bool spells, int64_t spell_cap, bool every) {
  const size_t R = owns.size();
  const uint64_t call = ++epoch;
  std::vector<std::vector<int64_t>> drafts(R);
  bool any = false;
  for (size_t r = 0; r < R; ++r) {
    SuffixIndexNative& own = *owns[r];
    if (spells && own.spell > 0 && own.idle_until > step) continue;
    own.pull_with_sources(call);
    const int64_t k = std::min(own.kcap, own.last - own.size());
    if (k <= 0) continue;
    const double scale = own.scale();
    auto [toks, probs] = suffix_draft(own, k, own.ngram, std::min(MIN_NGRAM, own.ngram), floor / scale);
    if (!toks.empty()) {
      own.spell = 0;
      for (double& q : probs) q = std::min(1.0, q * scale);
      own.proposed = std::move(probs);
      drafts[r] = std::move(toks);
      any = true;
    } else if (spells) {
      own.spell = own.spell == 0 ? 1 : std::min(spell_cap, 2 * own.spell);
      own.idle_until = step + own.spell;
    }
  }
  namespace py = pybind11;
  if (!every) {
    if (!any) return py::none();
    std::vector<std::pair<double, int64_t>> inc;  // NOTE: (estimate, row), the likeliest first: ties, the later row
    for (size_t r = 0; r < R; ++r)
      for (size_t j = 0; j < drafts[r].size(); ++j) inc.emplace_back(owns[r]->proposed[j], static_cast<int64_t>(r));
    std::sort(inc.begin(), inc.end(), [](const auto& a, const auto& b) { return a > b; });
    if (room >= 0 && static_cast<size_t>(room) < inc.size()) inc.resize(static_cast<size_t>(room));
    double gain = static_cast<double>(R), cost = c0, best = static_cast<double>(R);
    size_t keep = 0;
    for (size_t n = 0; n < inc.size(); ++n) {
      gain += inc[n].first;
      cost += dx;
      if (gain / cost > best) {
        best = gain / cost;
        keep = n + 1;
      }
    }
    if (keep == 0) return py::none();
    std::vector<size_t> lens(R, 0);
    for (size_t n = 0; n < keep; ++n) ++lens[static_cast<size_t>(inc[n].second)];  // NOTE: each row's a prefix
    for (size_t r = 0; r < R; ++r) drafts[r].resize(lens[r]);
  }
  py::list out(R);
  for (size_t r = 0; r < R; ++r) {
    py::list d(drafts[r].size());
    for (size_t j = 0; j < drafts[r].size(); ++j) d[j] = py::int_(drafts[r][j]);
    out[r] = std::move(d);
  }
  return out;
}

// whether any of `owns`' rows may draft from a suffix of 2+ tokens: each row (and its sources) brought up to date, and
// its last 2 tokens looked for among the pairs `suffix_draft` checks first (`Drafter.nothing_to_draft`: a tail of
// rows whose text does not repeat skips the step's drafting in one call)
bool any_pairs(const std::vector<SuffixIndexNative*>& owns) {
  const uint64_t call = ++epoch;
  for (auto* own : owns) {
    own->pull_with_sources(call);
    if (own->last_pair_occurs()) return true;
  }
  return false;
}

void bind_suffix_drafts(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<SuffixIndexNative>(m, "SuffixIndexNative", "rollout.sampling.drafts.SuffixIndex in C++ (its own tokens)")
      .def(py::init<int64_t>(), py::arg("max_n"))
      .def("bind", &SuffixIndexNative::bind, "the Python list of tokens `pull` copies", py::arg("tokens"))
      .def("pull", &SuffixIndexNative::pull, "the bound list's tokens from the last one copied on")
      .def("freeze", &SuffixIndexNative::freeze, "pull, then let the list go: its tokens are final")
      .def("configure", &SuffixIndexNative::configure, "its row's k, the position past which it does not draft, and "
           "its longest suffix matched (`plan_drafts`)", py::arg("kcap"), py::arg("last"), py::arg("ngram"))
      .def("record", &SuffixIndexNative::record, "Calibration.record of its last proposed draft's first `drafted` "
           "tokens, `kept` of them kept", py::arg("drafted"), py::arg("kept"))
      .def_property_readonly("scale", &SuffixIndexNative::scale, "its calibration's scale of its next estimates")
      .def_readonly("spell", &SuffixIndexNative::spell, "its idle spell's length (0: none)")
      .def_readonly("idle_until", &SuffixIndexNative::idle_until, "the step its idle spell ends at")
      .def("set_sources", &SuffixIndexNative::set_sources,
           "the other indexes this row's lookups read (kept alive by the caller)", py::arg("indexes"));
  m.def("suffix_drafts", &suffix_drafts, "Drafter.draft_many: each row's indexes pulled, then its suffix_draft",
        py::arg("owns"), py::arg("ks"), py::arg("max_ns"), py::arg("min_probs"));
  m.def("plan_drafts", &plan_drafts, "Speculator.plan past its gates: each row's draft cut to what pays, or None",
        py::arg("owns"), py::arg("floor"), py::arg("c0"), py::arg("dx"), py::arg("room"), py::arg("step"),
        py::arg("spells"), py::arg("spell_cap"), py::arg("every"));
  m.def("any_pairs", &any_pairs, "whether any row's last 2 tokens occur in its sources (each pulled first)",
        py::arg("owns"));
}
