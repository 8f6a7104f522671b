"""The workload classifier (DESIGN §4): rules first. Each rule is data (class, pattern,
weight, name); every match adds its weight to the class's score, and the best class at or
above a threshold wins, else a fallback. Configurable (RouterSettings.classifier_rules);
ADR 0006."""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import islice

CLASSES = ("code", "chat", "extraction")  # the built-in classes; policies may name more


@dataclass(frozen=True)
class Rule:
    """Each match of `pattern` adds `weight` to `workload_class`'s score."""

    workload_class: str
    pattern: str
    weight: float = 1.0
    name: str = ""
    ignore_case: bool = True

    def compiled(self) -> re.Pattern:
        return re.compile(self.pattern, (re.I if self.ignore_case else 0) | re.M)


class Classifier:
    """Rules first (DESIGN §4): every rule's matches add to its class's score, capped per
    rule; the best class at or above `threshold` wins, otherwise `fallback`. The reason names
    the rules that decided. Configurable (RouterSettings.classifier_rules); ADR 0006."""

    def __init__(self, rules: list[Rule] | None = None, threshold: float = 1.0, fallback: str = "chat",
                 per_rule_cap: int = 3) -> None:
        self.rules = [(r, r.compiled()) for r in (DEFAULT_RULES if rules is None else rules)]
        self.threshold = threshold
        self.fallback = fallback
        self.cap = per_rule_cap

    def classify(self, prompt: str) -> tuple[str, str]:
        scores: dict[str, float] = {}
        why: dict[str, list[str]] = {}
        # bounded work per request: the head and the tail of a long prompt
        text = prompt if len(prompt) <= 8000 else prompt[:4000] + "\n" + prompt[-4000:]
        for rule, rx in self.rules:
            n = sum(1 for _ in islice(rx.finditer(text), self.cap))
            if n:
                scores[rule.workload_class] = scores.get(rule.workload_class, 0.0) + n * rule.weight
                why.setdefault(rule.workload_class, []).append(rule.name or rule.pattern[:24])
        if scores:
            best = max(scores, key=lambda c: scores[c])
            if scores[best] >= self.threshold:
                return best, f"rules: {', '.join(why[best][:4])} (score {scores[best]:.1f})"
        return self.fallback, "no rule matched: fallback"


_LANG = (r"(?:python|javascript|typescript|node(?:\.js)?|js|ts|go|golang|rust|java|kotlin|swift|c\+\+|c#|ruby|php|"
         r"bash|shell|powershell|sql|postgres(?:ql)?|mysql|html|css|scala|haskell|lua|perl|react|django|flask|"
         r"pandas|numpy|pytorch|terraform|kubernetes|k8s|docker|yaml)")
_CODE_NOUN = (r"(?:function|method|class|script|program|snippet|(?!to |no )\w+ code|query|regex|regexp|"
              r"regular expression|unit tests?|test cases?|tests|endpoint|algorithm|bug|implementation|decorator|"
              r"hook|component|macro|one-liner|dockerfile|makefile|workflow|pipeline|cli|api|handler|middleware|"
              r"migration|schema migration|struct|interface|trait|module|library|package|model class|"
              r"pydantic model|dataclass|enum|loop|recursion|binary search|linked list|stack|queue|cache|"
              r"server|client|parser|lexer|compiler|shader|kernel|type|types|typings|generics|closure|"
              r"list comprehension|lambda|callback|promise|coroutine|goroutine|thread|mutex|counter|"
              r"crontab|cron job|alias|manifest|helm chart|resource|playbook|html|css|markup|layout|"
              r"navigation bar|navbar|quicksort|mergesort|merge sort|bubble sort|heap sort|dijkstra|bfs|dfs|"
              r"nn\.module|model|trie|graph|tree|hash ?map|web ?socket|scraper|crawler|bot|"
              r"(?:sed|awk|grep|find|bash|shell|git|docker|kubectl|ffmpeg|curl|jq|powershell) command|"
              r"terraform|config file|configuration file|config)")
_GAP = r"(?:[^\n.?!]|\.(?=\S)){0,80}"  # within one sentence ("nn.Module" does not end it)
DEFAULT_RULES: list[Rule] = [
    # -- what is asked (an instruction decides on its own) --
    Rule("extraction", r"\b(?:extract|extracting|pull out|scrape out)\b", 2.0, "extract"),
    Rule("extraction", r"\b(?:identify|find|list|tag|label|get|give me|pull|capture|collect|detect|recognize)\b"
                       r"[^\n.]{0,60}\b(?:names?|entities|organi[sz]ations|locations|dates|amounts|emails?|"
                       r"e-mail addresses|phone numbers|fields|attributes|values|skills|ingredients|"
                       r"action items)\b[^\n.]{0,60}\b(?:from|in)\b", 1.2, "find-entities"),
    Rule("extraction", r"\b(?:as|into|in|to|return|returns|output|produce|emit|give|format(?:ted)?(?: it)?(?: as)?)"
                       r"\s+(?:only\s+)?(?:[\w,.-]+\s+){0,3}(?:json|yaml|csv|tsv|xml|"
                       r"key[- ]value pairs?|key: ?value|structured|table row|single line of|record)\b", 2.0,
         "to-structure"),
    Rule("extraction", r"\A\s*(?:please\s+)?(?:extract|parse|convert|turn|normali[sz]e|fill|populate|identify|"
                       r"structure|tag|pull)\b", 1.0, "opens-with-extraction-task"),
    Rule("extraction", r"\b(?:as|into|in)\s+(?:a\s+)?(?:list|array|set) of (?:objects|records|dicts|dictionaries|"
                       r"rows|tuples|entries|key[- ]value pairs)\b", 2.0, "to-records"),
    Rule("extraction", r"\bfields?\s*:\s*\w+(?:,\s*\w+){2,}|\b(?:columns|keys)\s*:\s*\w+(?:,\s*\w+){2,}", 2.0,
         "field-list"),
    Rule("extraction", r"\b(?:fill|populate)\b[^\n]{0,30}\b(?:template|form|fields|schema|record)\b|"
                       r"\bnormali[sz]e\b[^\n]{0,40}\b(?:records|entries|rows|lines|data|addresses|names|numbers)\b|"
                       r"\bstructure (?:this|the|these)\b|\binto (?:our|the|my) (?:crm|database|db|spreadsheet|"
                       r"ticketing system|system|sheet)\b", 1.5, "fill-or-structure"),
    Rule("extraction", r"^[\w ]{1,30}(?:,[\w ]{0,30}){2,}\s*$|^[\w ]{1,30}(?:\|[\w ]{1,30}){2,}\s*$", 0.8, "csv-row",
         ignore_case=False),
    # several weak signals together: a list of fields, per-item output, a data verb, a source
    Rule("extraction", r"\b\w+(?:[ _]\w+)?(?:, \w+(?:[ _]\w+){0,2}){1,},? (?:and|or|plus) (?:the )?\w+", 0.7,
         "field-enumeration"),
    Rule("extraction", r"\b(?:for each|for every|each \w+ (?:with|as)|one per line|as rows|as a table|"
                       r"as (?:two |three )?(?:separate )?lists|in \w+=\w+ form|key=value|tagged|labell?ed|"
                       r"group(?:ed)? them by|\(\w+(?:, \w+){2,}\))", 0.7, "per-item"),
    Rule("extraction", r"\b(?:tabulate|grab|capture|record|log|tag|identify|make a table of|go through|"
                       r"tell me the|list (?:the|every|all|each))\b", 0.6, "data-verb"),
    Rule("extraction", r"\b(?:from|in) (?:this|the following|these|the) (?:\w+ ){0,2}(?:notice|report|note|sentence|"
                       r"post|paragraph|itinerary|docket|statement|email|text|listing|transcript|message|receipt|"
                       r"invoice|resume|résumé|log|bulletin|record|reviews?|article|document|chat|page|thread|"
                       r"letter|notes|prescription|recipe|blog \w+)\b", 0.5, "source-reference"),
    Rule("extraction", r"^(?!User|Assistant|Human|AI|Q|A|Customer|Agent)[A-Z][\w ]{1,20}: \S[^\n]{0,80}$", 0.3,
         "header-fields", ignore_case=False),
    Rule("extraction", r"^\s*[A-Z][\w ]{0,20}: [^|\n]{1,60} \| [A-Z][\w ]{0,20}: ", 1.0, "pipe-record",
         ignore_case=False),
    Rule("extraction", r"\b(?:json|yaml|csv)\s+(?:object|array|list|record|row|document|format|output|with "
                       r"(?:the )?(?:keys|fields|columns))\b", 1.5, "structure-object"),
    Rule("extraction", r"\b(?:parse|split|break down|normali[sz]e|convert|turn|map)\b[^\n]{0,80}\b(?:into|to)\b"
                       r"[^\n]{0,40}(?:fields|columns|keys|components|parts|(?:\w+, ){2,})", 1.5, "parse-into"),
    Rule("extraction", r"\b(?:fill in|fill out|complete)\b[^\n]{0,40}(?:form|template|fields|schema|blanks|:)|"
                       r"\bschema\b|\bnamed[- ]entit(?:y|ies)\b|\bkey[- ]value\b", 1.5, "fill-schema"),
    Rule("code", rf"\b(?:write|implement|create|generate|complete|refactor|optimi[sz]e|debug|fix|rewrite|port|"
                 rf"translate|convert|add|build|make|code up|sketch|give me|show me|need|define)\b{_GAP}"
                 rf"\b{_CODE_NOUN}\b", 2.0, "code-instruction"),
    Rule("code", rf"\A\s*(?:please\s+)?(?:write|implement|create|generate|refactor|fix|debug|build|code|port|"
                 rf"translate|optimi[sz]e)\b{_GAP}\b{_CODE_NOUN}\b", 1.0, "opens-with-code-task"),
    Rule("code", rf"\b(?:implement|write|code|program|translate|port|convert|rewrite)\b{_GAP}\b(?:in|using|with|to|"
                 rf"into) {_LANG}\b", 2.0,
         "implement-in-language"),
    Rule("code", rf"\b(?:in|using|with|to) {_LANG}\b", 0.6, "language"),
    Rule("code", r"\b(?:what'?s wrong with|review|why does|why doesn'?t|explain) (?:this|my|the following) "
                 r"(?:code|function|snippet|query|script|diff|regex|sql)\b|\bfix (?:it|this|the error)\b|"
                 r"\bjust the code\b|\bcode only\b|\bno explanation\b", 2.0, "code-review"),
    # -- what the prompt looks like --
    Rule("code", r"```(?!json|yaml|csv)", 0.8, "fence"),
    Rule("code", r"^\s*(?:def \w+\(|class \w+|import \w|from [\w.]+ import |async def |@\w+|data class \w+|"
                 r"fun \w+\(|val \w+ =|(?:pub )?fn \w+|func \w+)", 1.0,
         "python-definition", ignore_case=False),
    Rule("code", r"^\s*(?:return|elif|except|raise|yield|with \w.*:$|for .+ in .+:$|while .*:$|if .*:$|try:$|"
                 r"#\s)|^\s*\w+(?:\.\w+)*\(.*\)\s*$", 0.5, "python-syntax", ignore_case=False),
    Rule("code", r"^\s*(?:for \w+ in .*; ?do|do|done|fi|then|esac|else)\s*$|^\s*//|^\s*/\*|"
                 r"^\s*[\w:<>*&]+(?:\s+[\w:<>*&]+)*\s+\**\w+\([^)]*\)\s*(?:const\s*)?\{?\s*$",
         0.8, "shell-or-c-lines", ignore_case=False),
    Rule("code", r"^\s*(?:for \w+ in .*; ?do|while .*; ?do)\s*$|\b(?:sed|awk|grep|find|bash|shell|git|docker|kubectl|"
                 r"ffmpeg|curl|jq|powershell|terminal) (?:command|one-liner)\b", 1.0, "shell-command"),
    Rule("code", r"\bself\.\w+|^\s+\w+(?:\.\w+|\[[^\]\n]*\])* [-+*/|&]?= \S|^\s*(?:else|try|finally):\s*$|"
                 r"\w\[[^\]\n]*:[^\]\n]*\]|\bNone\b|\b__\w+__\b", 0.5, "python-body", ignore_case=False),
    Rule("code", r"\b(?:dockerfile|makefile|github actions|gitlab ci|helm chart|regex|regexp|regular expression|"
                 r"bash script|shell script|unit tests?|docstring|type hints?|lint(?:er)?|stack trace|compiler)\b",
         1.0, "code-artifact"),
    Rule("code", r"^\s*(?:function|const|let|var|export|interface|type \w+ =|public|private|protected|static|fn|"
                 r"func|impl|package|#include|#define|using namespace|struct|enum|module|use \w|"
                 r"template\s*<)\b", 0.7, "c-family-syntax", ignore_case=False),
    Rule("code", r"[;{]\s*$|^\s*[})\]];?,?\s*$|=>|->|::|\+\+|&&|\|\||!==?|===?|\w\[\w*\]|\w+\.\w+\(", 0.35,
         "punctuation"),
    Rule("code", r"^\s*(?:SELECT|INSERT INTO|UPDATE \w+ SET|DELETE FROM|CREATE (?:TABLE|INDEX|VIEW)|WITH \w+ AS)\b",
         1.0, "sql"),
    Rule("code", r"^\s*<(?:!DOCTYPE|html|div|span|script|style|body|head|template|button|form|ul|li|p|a|img)\b|"
                 r"^\s*[.#]?[\w-]+(?:\s*[>:.#][\w-]+)*\s*\{\s*$", 0.7, "markup"),
    Rule("code", r"^\s*(?:\$ |#!|sudo |git |pip |npm |yarn |docker |kubectl |cd |ls |grep |awk |sed |curl |"
                 r"set -[euxo]|export \w+=|FROM \S+|RUN |COPY |CMD |apiVersion:|kind: \w+|on:\s*$|jobs:\s*$)", 1.0,
         "shell-or-config"),
    Rule("code", r"Traceback \(most recent call last\)|\b\w+(?:Error|Exception)\b: |\bat [\w.$]+\(\w+\.\w+:\d+\)|"
                 r"segmentation fault|undefined reference|panicked at|error\[E\d+\]|^\s*File \"[^\"]+\", line \d+",
         1.0, "error-trace"),
    Rule("code", r"^[-+]{3} [ab]/|^@@ -\d+", 1.0, "diff"),
    Rule("extraction", r"^\s*\{\s*$|^\s*\{\s*\"|\"[\w ]+\"\s*:\s*(?:\"|\d|\[|\{|null|true|false|$)", 0.5,
         "json-syntax"),
    Rule("extraction", r"^\s*\"?[A-Z][\w ]{1,30}\"?\s*:\s*(?:_{2,}|\?|$)|\b\w+=\.\.\.|^\s*\w+=\s*$|[{\[]\s*$", 0.5,
         "open-field"),
]
