// The `epmoe` command-line tool.
#include <epmoe/error.hpp>
#include <epmoe/group.hpp>
#include <epmoe/version.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <regex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "commands.hpp"

namespace {

using epmoe::cli::as_typed;

/// This process's rank as its launcher set it ("0" outside one). Launchers' rank variables: Open MPI, PMI (MPICH,
/// Slurm), PMIx.
const char* launcher_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"})
    if (const char* v = std::getenv(var); v != nullptr && *v != '\0') return v;
  return "0";
}
/// Under mpirun every process parses the same command line: only the first says what parsing found (help, a bad
/// flag), not one copy per rank.
bool first_or_only_process() { return std::strcmp(launcher_rank(), "0") == 0; }

/// `message` ("epmoe: ...") as a process other than the first says it under a launcher: "epmoe: rank N: ...", so a
/// refusal of one rank's own flags says whose they were (unchanged where it already names a rank first).
std::string naming_the_rank(const std::string& message) {
  if (first_or_only_process() || message.rfind("epmoe: ", 0) != 0) return message;
  return epmoe::naming_rank(message, std::atoi(launcher_rank()));  // the library's wording (run_thread_ranks')
}

/// The option `flag` ("--ranks") of the command that was parsed, or null.
const CLI::Option* parsed_option(const CLI::App& app, const std::string& flag) {
  for (const CLI::App* sub : app.get_subcommands())
    if (const CLI::Option* o = sub->get_option_no_throw(flag); o != nullptr) return o;
  return nullptr;
}

/// The kind of value an option takes, read from CLI11's type name (INT, UINT, FLOAT, TEXT, PATH, FILE; INT and UINT
/// for every integer width): the one place the messages below learn it.
enum class ValueKind { signed_integer, unsigned_integer, number, path, text };
ValueKind kind_of(const CLI::Option& o) {
  const std::string type = o.get_type_name();
  if (type.rfind("UINT", 0) == 0) return ValueKind::unsigned_integer;
  if (type.rfind("INT", 0) == 0) return ValueKind::signed_integer;
  if (type.rfind("FLOAT", 0) == 0) return ValueKind::number;
  if (type == "PATH" || type == "FILE") return ValueKind::path;
  return ValueKind::text;
}
bool is_integer(ValueKind k) { return k == ValueKind::signed_integer || k == ValueKind::unsigned_integer; }

/// What an option of kind `k` takes, as the messages say it.
std::string value_kind(ValueKind k) {
  if (is_integer(k)) return "a decimal integer";
  return k == ValueKind::number ? "a number" : k == ValueKind::path ? "a path" : "a value";
}

/// CLI11 says "Could not convert: --tolerance = abc" for a value its option's type cannot read (integers are refused
/// before, by read_integers_in_decimal: a spelling that is not decimal, or a value past the type's range): said here as
/// the commands' own errors are, with what the option takes ("a number"), or "" when `e` is not such an error.
std::string conversion_message(const CLI::App& app, const CLI::ParseError& e) {
  const std::string what = e.what(), head = "Could not convert: ";
  const auto eq = what.find(" = ");
  if (what.rfind(head, 0) != 0 || eq == std::string::npos) return "";
  const std::string flag = what.substr(head.size(), eq - head.size()), value = what.substr(eq + 3);
  const CLI::Option* o = parsed_option(app, flag);
  const std::string expected = o != nullptr ? value_kind(kind_of(*o)) : "a value";
  return "epmoe: invalid argument '" + flag + "': expected " + expected + " in range (see --help), got " +
         as_typed(value);
}

/// CLI11 says "--device: At Most 1 required but received 2" for an option of one value given twice (its policy
/// refuses rather than keep one silently; refuse_repeated_flags gives flags that policy too): said as the commands'
/// own errors are, with the values given ("--overlap given twice" for a flag), or "" when `e` is not such an error.
std::string repeated_message(const CLI::App& app, const CLI::ParseError& e) {
  const std::string what = e.what(), mid = ": At Most 1 required but received ";
  const auto at = what.find(mid);
  if (e.get_name() != "ArgumentMismatch" || at == std::string::npos) return "";
  const std::string flag = what.substr(0, at), count = what.substr(at + mid.size());
  const CLI::Option* o = parsed_option(app, flag);
  if (o != nullptr && o->get_expected_max() == 0)  // a flag: no values to list
    return "epmoe: invalid argument '" + flag + "': expected once (it takes no value), got " + flag +
           " given " + (count == "2" ? std::string("twice") : count + " times");
  std::string values;
  for (const std::string& v : o != nullptr ? o->results() : std::vector<std::string>{})
    values += (values.empty() ? "" : ", ") + as_typed(v);
  return "epmoe: invalid argument '" + flag + "': expected once (it takes one value), got " + count + " values" +
         (values.empty() ? "" : ": " + values);
}

/// Edit distance of two flag names (case-insensitive), for the suggestion of extras_message.
std::size_t flag_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      const bool same = std::tolower(static_cast<unsigned char>(a[i - 1])) ==
                        std::tolower(static_cast<unsigned char>(b[j - 1]));
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (same ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

/// CLI11 says "The following arguments were not expected: 4 --tokne" (the words reversed) for an unknown flag: said
/// as the commands' own errors are, naming the first unknown word and, for a flag, the command's nearest flag (at
/// most two edits away, or the same but for case); "" when `e` is not such an error. `args` is the command line
/// (argv[1..], up to a "--": the words after it are not parsed, see positional_message).
std::string extras_message(const CLI::App& app, const CLI::ParseError& e, const std::vector<std::string>& args) {
  if (dynamic_cast<const CLI::ExtrasError*>(&e) == nullptr) return "";  // its name is the command's
  const std::vector<CLI::App*> subs = app.get_subcommands();
  const CLI::App* sub = subs.empty() ? &app : subs.front();
  std::vector<std::string> extras = sub->remaining();
  if (extras.empty()) extras = app.remaining();  // a subcommand hands its extras up to the app
  if (extras.empty()) return "";
  const std::string command = subs.empty() ? std::string("epmoe") : sub->get_name();
  // A word before the command ("epmoe help run"): CLI11 still found the command after it, and the word reads as the
  // command's positional argument; the place is the mistake.
  if (sub != &app && extras.front()[0] != '-') {
    const auto at = std::find(args.begin(), args.end(), command);
    if (std::find(args.begin(), at, extras.front()) != at)
      return "epmoe: invalid argument '" + extras.front() + "': expected the command first (run, bench or tune), got " +
             as_typed(extras.front()) + " before '" + command + "'" +
             (extras.front() == "help" ? " (for a command's help: epmoe " + command + " --help)" : " (see --help)");
  }
  const auto flag =
      std::find_if(extras.begin(), extras.end(), [](const std::string& w) { return w.size() > 1 && w[0] == '-'; });
  if (flag == extras.end())
    return "epmoe: invalid argument '" + extras.front() + "': expected a flag (" + command +
           " takes no positional arguments), got " + as_typed(extras.front()) + " (see --help)";
  const std::string name = flag->substr(0, flag->find('='));
  // A command's flag typed before the command ("epmoe --tokens 3 run"): the place is the mistake, not the name.
  if (sub != &app && sub->get_option_no_throw(name) != nullptr) {
    const auto at = std::find(args.begin(), args.end(), command);
    if (std::any_of(args.begin(), at, [&](const std::string& w) { return w.substr(0, w.find('=')) == name; }))
      return "epmoe: invalid argument '" + name + "': expected the flags after the command (epmoe " + command + " " +
             name + " ...), got it before '" + command + "'";
  }
  std::string best;
  std::size_t best_distance = 3;
  for (const CLI::Option* o : sub->get_options())
    for (const std::string& l : o->get_lnames()) {
      const std::size_t d = flag_distance(name, "--" + l);
      if (d < best_distance) best = "--" + l, best_distance = d;
    }
  return "epmoe: invalid argument '" + name + "': expected a flag of " + command + ", got " + as_typed(name) +
         (best.empty() ? "" : "; did you mean " + best + "?") + " (see epmoe " + command + " --help)";
}

/// A word after "--" (`run --ranks 4 -- --tokens 8`, `run -- -h`): no command takes positional arguments, and such a
/// word is never a flag, so it is refused as that. The words after "--" are kept from CLI11, which read "-h" or
/// "--version" there as the app's flags (the "--" ended the command's words only, not the app's): said once the
/// words before it parsed, so a mistake there is named first.
std::string positional_message(const CLI::App& app, const std::string& word) {
  const std::vector<CLI::App*> subs = app.get_subcommands();
  const std::string command = subs.empty() ? std::string("epmoe") : subs.front()->get_name();
  return "epmoe: invalid argument '" + word + "': expected no positional arguments (" + command +
         " takes none; see epmoe " + command + " --help), got " + as_typed(word) + " after '--'" +
         (word.size() > 1 && word[0] == '-' ? " (so it was not read as a flag)" : "");
}

/// A word after "--" where the command goes (`epmoe -- run`): the words after "--" are never flags or commands, so no
/// command came; named as typed, where CLI11's "a subcommand is required" read "got none".
std::string command_after_mark_message(const std::string& word) {
  return "epmoe: invalid argument '" + word + "': expected a command (run, bench or tune) before '--', got " +
         as_typed(word) + " after it (words after '--' are never flags or commands)";
}

/// The range integer option `o` takes, as a value past its type is refused with: from the least value at_least or
/// in_range declared ("[1, 2147483647]" for --ranks), else its type's, to the most in_range declared ("[1, 32]" for
/// --topk), else its type's largest ("[-2147483648, 2147483647]" for an int).
/// CLI11 names every integer type INT or UINT, so the type is the widest of 8, 16, 32 and 64 bits whose largest value
/// the option's own conversion takes. That conversion writes the option's variable: called only for a value about to
/// be refused.
std::string integer_range(const CLI::Option& o, bool is_unsigned) {
  const CLI::callback_t convert = o.get_callback();
  const auto most = [is_unsigned](int bits) { return ~std::uint64_t{0} >> (64 - bits + (is_unsigned ? 0 : 1)); };
  int bits = 8;
  for (const int wider : {16, 32, 64}) {
    if (!convert({std::to_string(most(wider))})) break;
    bits = wider;
  }
  const std::string largest = std::to_string(most(bits));
  if (const std::optional<epmoe::cli::DeclaredRange> range = epmoe::cli::declared_range(o))
    return "[" + std::to_string(range->least) + ", " + (range->most ? std::to_string(*range->most) : largest) + "]";
  return is_unsigned ? "[0, " + largest + "]" : "[-" + std::to_string(most(bits) + 1) + ", " + largest + "]";
}

/// Calls fn(sub, option) for every option of every subcommand (the edits below apply to all commands alike).
template <class Fn>
void for_each_option(CLI::App& app, Fn&& fn) {
  for (CLI::App* sub : app.get_subcommands({}))
    for (CLI::Option* o : sub->get_options()) fn(*sub, o);
}

/// Integer options read their values in decimal, as typed: CLI11 converts with strtoll(v, 0, 0), so "010" was 8
/// (octal), "0x10" 16, and a value past 64 bits was clamped to the type's limit, which the range checks then named as
/// if typed. Only an optional sign and decimal digits are taken (not "0x10", "1e3", " 2" or ""); a decimal value loses
/// its leading zeros; one past the option's type (64 bits, or 32 for an int, whose conversion CLI11 refused as "Could
/// not convert") is refused with the value as given and the option's range (integer_range).
void read_integers_in_decimal(CLI::App& app) {
  for_each_option(app, [](CLI::App&, CLI::Option* o) {
    const ValueKind kind = kind_of(*o);
    if (!is_integer(kind)) return;
    const bool is_unsigned = kind == ValueKind::unsigned_integer;
    o->transform(CLI::Validator(
        [o, is_unsigned](std::string& v) -> std::string {
          if (std::string not_decimal = epmoe::cli::decimal_integer_error(v); !not_decimal.empty()) return not_decimal;
          const std::size_t sign = v[0] == '-' || v[0] == '+' ? 1 : 0;
          std::size_t first = v.find_first_not_of('0', sign);
          if (first == std::string::npos) first = v.size() - 1;  // all zeros: keep one
          const std::string digits = v.substr(first), decimal = v.substr(0, sign) + digits;
          const std::string most = is_unsigned ? "18446744073709551615"
                                   : v[0] == '-' ? "9223372036854775808"
                                                 : "9223372036854775807";
          // Past 64 bits strtoll saturates (a conversion that "works"); below, the option's own conversion says
          // (writing the value into the option's variable, as the conversion right after this check does).
          const bool past_64_bits = digits.size() > most.size() || (digits.size() == most.size() && digits > most);
          if (past_64_bits || !o->get_callback()({decimal}))
            return "expected an integer in " + integer_range(*o, is_unsigned) + ", got " + v;
          v = decimal;
          return "";
        },
        "", "decimal"));
  });
}

/// Number options (--tolerance) read decimal spellings only, as integers do: CLI11's conversion also took " 0.01",
/// "0x1p-7", "inf" and "nan". A sign, digits with an optional point, an optional exponent.
void read_numbers_in_decimal(CLI::App& app) {
  for_each_option(app, [](CLI::App&, CLI::Option* o) {
    if (kind_of(*o) != ValueKind::number) return;
    o->transform(CLI::Validator(
        [](std::string& v) -> std::string {
          static const std::regex decimal(R"([+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?)");
          return std::regex_match(v, decimal) ? ""
                                              : "expected a decimal number (such as 0.01 or 1e-3), got " + as_typed(v);
        },
        "", "decimal number"));
  });
}

/// What is said of an empty value given to an option of kind `k`: "expected <kind>, got an empty value" (path options'
/// own check, non_empty_path, says it so too).
std::string empty_value_message(ValueKind k) { return "expected " + value_kind(k) + ", got an empty value"; }

/// An empty value (`--tokens ""`, an unset shell variable) is refused for every option that takes one: CLI11 read it
/// as 0 for a number and as "" for a list, so a run went on as if a value were given. Runs before the option's own
/// checks (a transform goes first), so it is said the same way for all; path options (PATH, FILE) have their own
/// check of the same words.
void refuse_empty_values(CLI::App& app) {
  for_each_option(app, [](CLI::App&, CLI::Option* o) {
    const ValueKind kind = kind_of(*o);
    if (o->get_expected_max() == 0 || kind == ValueKind::path) return;
    o->transform(CLI::Validator(
        [message = empty_value_message(kind)](std::string& v) { return v.empty() ? message : std::string(); }, "",
        "non-empty"));
  });
}

/// Any other parse error: CLI11 says a check's refusal as "--tokens: expected ..." and a choice's as "--device: gpu
/// not in {auto,cpu,cuda}"; said as the commands' own errors are ("invalid argument '--device': expected one of auto,
/// cpu, cuda, got gpu"), one style for every message.
std::string option_message(const CLI::ParseError& e) {
  const std::string what = e.what();
  if (e.get_name() == "RequiredError" && what.find("subcommand") != std::string::npos)
    return "epmoe: invalid argument 'command': expected run, bench or tune (see --help), got none";
  const auto colon = what.find(": ");
  if (what.rfind("--", 0) != 0 || colon == std::string::npos || what.find(' ') < colon)
    return "epmoe: invalid argument: " + what + " (see --help)";
  const std::string flag = what.substr(0, colon), rest = what.substr(colon + 2);
  static const std::regex choice(R"((.*) not in \{(.*)\})");
  if (std::smatch m; std::regex_match(rest, m, choice)) {
    std::string choices = m[2];
    for (std::size_t at = choices.find(','); at != std::string::npos; at = choices.find(',', at + 2))
      choices.replace(at, 1, ", ");
    return "epmoe: invalid argument '" + flag + "': expected one of " + choices + ", got " + as_typed(m[1].str()) +
           " (see --help)";
  }
  return "epmoe: invalid argument '" + flag + "': " + rest + " (see --help)";
}

/// CLI11 says "--tokens: 1 required INT missing" for `--tokens` last on the line, with no value at all: said as
/// "expected a decimal integer after it, got nothing". "" when `e` is not such an error. (`--tokens=` never gets here:
/// flag_value_message refuses it before parsing.)
std::string missing_value_message(const CLI::App& app, const CLI::ParseError& e) {
  const std::string what = e.what();
  const auto colon = what.find(": ");
  if (e.get_name() != "ArgumentMismatch" || colon == std::string::npos || what.find(" missing", colon) == std::string::npos)
    return "";
  const std::string flag = what.substr(0, colon);
  const CLI::Option* o = parsed_option(app, flag);
  if (o == nullptr) return "";
  return "epmoe: invalid argument '" + flag + "': expected " + value_kind(kind_of(*o)) +
         " after it, got nothing (see --help)";
}

/// A flag given twice (`--overlap --overlap`) is refused as an option of one value given twice is (repeated_message):
/// CLI11 keeps the last silently (no flag here counts its repeats). --help given twice still prints the help.
void refuse_repeated_flags(CLI::App& app) {
  for_each_option(app, [](CLI::App& sub, CLI::Option* o) {
    if (o->get_expected_max() == 0 && o != sub.get_help_ptr()) o->multi_option_policy(CLI::MultiOptionPolicy::Throw);
  });
}

/// A flag given a value (`--eplb=foo`, `--overlap=2`, `--overlap=`) and an option given an empty one by "="
/// (`--tokens=`) are refused, before parsing: CLI11 read "=2" as a count and "=" or "=true" as set, "=foo" failed as
/// "a value in range", and "--tokens= 16" took the next word. Words before the command are read as the app's
/// options (--version=1), words after it as the command's, up to "--". "" when there is none.
std::string flag_value_message(CLI::App& app, const std::vector<std::string>& args) {
  const CLI::App* command = nullptr;  // the options of the words read: the app's (--version) until the command
  for (auto w = args.begin(); w != args.end() && *w != "--"; ++w) {
    if (command == nullptr && !w->empty() && (*w)[0] != '-')
      for (const CLI::App* s : app.get_subcommands({}))
        if (s->get_name() == *w) command = s;
    const auto eq = w->find('=');
    if (w->rfind("--", 0) != 0 || eq == std::string::npos) continue;
    const std::string flag = w->substr(0, eq);
    const CLI::Option* o = (command != nullptr ? command : &app)->get_option_no_throw(flag);
    if (o != nullptr && o->get_expected_max() == 0)
      return "epmoe: invalid argument '" + flag + "': expected no value (it is a flag: " + flag + " alone), got " +
             as_typed(*w);
    // "--tokens=" then a word: CLI11 took the next word as the value ("--tokens= 16" ran with 16).
    if (o != nullptr && eq + 1 == w->size())
      return "epmoe: invalid argument '" + flag + "': " + empty_value_message(kind_of(*o)) + " (see --help)";
  }
  return "";
}

/// A help request beside other words ("epmoe run -h --tokens abc"): the words to parse instead, the program name, the
/// command (when one comes before the -h) and --help, so the help wins over any bad flag beside it, as in most tools.
/// Empty when there is no -h / --help before a "--".
std::vector<std::string> help_request(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  const auto end = std::find(args.begin(), args.end(), "--");
  const auto help = std::find_if(args.begin(), end, [](const std::string& w) { return w == "-h" || w == "--help"; });
  if (help == end || args.size() == 1) return {};
  std::vector<std::string> words{argv[0]};
  const auto command = std::find_if(args.begin(), end, [](const std::string& w) {
    return w == "run" || w == "bench" || w == "tune";
  });
  if (command != end) words.push_back(*command);
  words.emplace_back("--help");
  return words;
}

/// Says why the command was refused and returns `status`. Under mpirun every process parses the same line and checks
/// the same flags: the first says it at once; another says it after a pause, naming itself. mpirun stops the job at
/// the first non-zero exit, so when the first process refused alike the job stops during that pause (one message,
/// not one per rank); when only this rank's line differs (an MPMD launch), nobody else speaks.
int refuse(const std::string& message, int status) {
  if (!first_or_only_process()) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  std::fprintf(stderr, "%s\n", naming_the_rank(message).c_str());
  return status;
}
/// A refused command line: exit status 2.
int refuse_command_line(const std::string& message) { return refuse(message, 2); }

/// The exit status of a command that raised `code`: 2 for bad arguments (and requests this machine cannot serve:
/// sizes past its memory, no GPU); 1 for a failure while running (a timeout, a broken group or buffer, an internal
/// error, results that could not be written), as a failed check.
int exit_status(epmoe::ErrorCode code) {
  const bool failure = code == epmoe::ErrorCode::timeout || code == epmoe::ErrorCode::internal ||
                       code == epmoe::ErrorCode::unusable;
  return failure ? 1 : 2;
}

/// A standard output that cannot be written (`> /dev/full`, closed): said as that, not as a bug or a success; exit 1
/// (a failure while running), whether the job's output or the help failed.
int standard_output_failed(const std::string& reason) {
  std::fprintf(stderr, "epmoe: could not write to standard output (%s)\n", reason.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  // stdout line-buffered, as on a terminal: through a pipe or file shared with stderr (2>&1), the header and table
  // lines then come out where they do on a terminal, not after the progress lines written to stderr meanwhile.
  std::setvbuf(stdout, nullptr, _IOLBF, BUFSIZ);
  CLI::App app{"epmoe: expert-parallel Mixture-of-Experts dispatch, experts and combine"};
  app.require_subcommand(1);
  const std::string failure =
      "a failure while running (a timeout, an internal error, results that could not be written)";
  const std::string refused =
      "2 bad arguments, or a request this machine cannot serve (no GPU, sizes past its memory).";
  app.footer("Exit status: 0 success (run: PASS); 1 a failed check (run: FAIL) or " + failure + "; " + refused);
  app.set_version_flag("--version", std::string(epmoe::version()));
  auto run = epmoe::cli::add_run_command(app);
  auto bench = epmoe::cli::add_bench_command(app);
  auto tune = epmoe::cli::add_tune_command(app);
  // Each command's help ends with its own exit statuses: a command is made with the app's footer, which speaks of run.
  app.get_subcommand("run")->footer("Exit status: 0 PASS; 1 FAIL or " + failure + "; " + refused);
  for (const char* name : {"bench", "tune"})
    app.get_subcommand(name)->footer("Exit status: 0 success; 1 " + failure + "; " + refused);
  read_integers_in_decimal(app);
  read_numbers_in_decimal(app);
  refuse_empty_values(app);  // after: its transform then runs first
  refuse_repeated_flags(app);
  std::vector<std::string> help_words = help_request(argc, argv);
  std::vector<char*> help_argv;
  for (std::string& w : help_words) help_argv.push_back(w.data());
  if (!help_argv.empty()) {
    argc = static_cast<int>(help_argv.size());
    argv = help_argv.data();
  }
  // The words after a "--" are not given to CLI11 (positional_message says why): refused once the others parsed.
  const auto mark = std::find_if(argv + 1, argv + argc, [](const char* w) { return std::strcmp(w, "--") == 0; });
  const std::vector<std::string> after_mark(mark + (mark != argv + argc ? 1 : 0), argv + argc);
  argc = static_cast<int>(mark - argv);
  if (const std::string m = flag_value_message(app, std::vector<std::string>(argv + 1, argv + argc)); !m.empty())
    return refuse_command_line(m);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every other parse error is a bad argument: 2, as the README says, in the
    // same shape as the commands' own errors.
    const bool say = first_or_only_process();
    if (e.get_exit_code() == 0 && !say) return 0;
    if (e.get_exit_code() == 0) {
      // The help or version goes to std::cout, which writes through stdout: a failed write sets its error flag.
      errno = 0;
      const int code = app.exit(e);
      if (std::fflush(stdout) != 0 || std::ferror(stdout) != 0)
        return standard_output_failed(errno != 0 ? std::strerror(errno) : "a write failed");
      return code;
    }
    const std::vector<std::string> args(argv + 1, argv + argc);
    std::string message;
    if (app.get_subcommands().empty() && argc > 1 && argv[1][0] == '-')  // a flag where the command goes
      message = fmt::format(
          "epmoe: invalid argument '{0}': expected a command first (run, bench or tune), got {1} (see --help)", argv[1],
          as_typed(argv[1]));
    else if (app.get_subcommands().empty() && argc > 1)  // a word that is no command (not CLI11's message)
      message =
          fmt::format("epmoe: invalid argument '{0}': expected a command (run, bench or tune), got {1} (see --help)",
                      argv[1], as_typed(argv[1]));
    else if (app.get_subcommands().empty() && !after_mark.empty())  // only words after a "--" (`epmoe -- run`)
      message = command_after_mark_message(after_mark.front());
    else if (std::string m = conversion_message(app, e); !m.empty())
      message = std::move(m);
    else if (std::string q = missing_value_message(app, e); !q.empty())
      message = std::move(q);
    else if (std::string r = repeated_message(app, e); !r.empty())
      message = std::move(r);
    else if (std::string x = extras_message(app, e, args); !x.empty())
      message = std::move(x);
    else
      message = option_message(e);
    return refuse_command_line(message);
  }
  if (!after_mark.empty()) return refuse_command_line(positional_message(app, after_mark.front()));
  try {
    if (app.got_subcommand("run")) return run();
    if (app.got_subcommand("bench")) return bench();
    if (app.got_subcommand("tune")) return tune();
  } catch (const epmoe::cli::AlreadyReported& e) {
    return exit_status(e.code());
  } catch (const epmoe::Error& e) {
    // A refusal of the flags or of settings that differ: under mpirun every process usually raises it alike (its own
    // checks, before or without a group that could agree on who speaks), so it is said as the command line's are.
    if (e.code() == epmoe::ErrorCode::invalid_argument || e.code() == epmoe::ErrorCode::rank_mismatch)
      return refuse(e.what(), exit_status(e.code()));
    std::fprintf(stderr, "%s\n", naming_the_rank(e.what()).c_str());
    return exit_status(e.code());
  } catch (const std::system_error& e) {
    // fmt's print to a full or closed standard output (`> /dev/full`, its error flag set): said as that, not as a bug.
    if (std::ferror(stdout) != 0) return standard_output_failed(e.code().message());
    std::fprintf(stderr, "epmoe: internal error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    // Not an epmoe error: a bug or a library's own failure. Said, never a crash (exit 1: not a bad argument).
    std::fprintf(stderr, "epmoe: internal error: %s\n", e.what());
    return 1;
  }
  return 0;
}
