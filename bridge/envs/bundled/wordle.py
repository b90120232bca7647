"""`wordle`: guess a secret 5-letter English word in 6 tries from letter feedback.

Action `WordleAction(guess: str)` (case and surrounding whitespace are ignored).
Observation `WordleObservation`: `text` (what to show the model), `guesses` (the valid guesses
so far, lowercase), `patterns` (one per valid guess: per letter `G` right letter in the right
place, `Y` in the word elsewhere, `-` not in the word or no copy left), `guesses_left`,
`valid` / `error` (about the last guess), `solved`, `answer` (revealed once the episode ends),
plus `done`, `reward`.

Feedback handles repeated letters the standard way: greens first, then yellows left to right,
each consuming one of the answer's unmatched copies of that letter (answer "apple", guess
"papal": `YYG-Y`, the second `a` is gray because the answer has one `a`).

Invalid guesses (not 5 letters a-z, or not in `WORDS`) get a message saying what was wrong
and **count as one of the tries** (so an episode always ends within `max_guesses` steps).

Task fields: `answer` (a word of `WORDS`), `max_guesses` (1-10, default 6), `partial_credit`
(default false). Reward: 0.0 on every step but the last; 1.0 on a solve; when the tries run
out, 0.0, or with `partial_credit` `0.5 * max over valid guesses of (greens + 0.5 * yellows) / 5`.
Done on a solve or when the tries run out.

`WORDS` (510 common words, embedded) are both the answers and the allowed guesses; an answer is
held out ("test") by a stable hash, `answers(split)` lists a split's. Solver: `solve(history)`
keeps the words consistent with all feedback so far and guesses the word (from all of `WORDS`)
whose worst-case feedback leaves the fewest candidates; it solves every answer in at most 4
guesses (the tests check every held-out one).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from typing import Any

from openenv.core.env_server import Action, Observation
from pydantic import Field

from bridge.envs.bundled import BundledEnv
from bridge.envs.bundled._base import (
    BundledEnvironment, Episode, as_dict, check_bool, check_int, check_split, play, seeded_rng,
    split_of,
)

WORDS: tuple[str, ...] = tuple("""
about above actor acute admit adopt adult after again agent agree ahead alarm album alert
alike alive allow alone along alter among anger angle angry apart apple apply arena argue
arise array aside asset audio avoid award aware badly baker basic beach began begin being
below bench birth black blade blame blank blind block blood board boast bonus boost booth
bound brain brand brave bread break breed brick bride brief bring broad broke brown brush
build built buyer cabin cable candy carry catch cause chain chair charm chart chase cheap
check chest chief child chose civil claim class clean clear clerk click climb clock close
cloud coach coast could count court cover craft crash cream crime cross crowd crown curve
cycle daily dance dated dealt death debut delay depth dirty doubt dozen draft drama drank
dream dress drink drive drove dying eager early earth eight elite empty enemy enjoy enter
entry equal error event every exact exist extra faith false fancy fault fiber field fifth
fifty fight final first flash fleet floor fluid focus force forth forty forum found frame
frank fraud fresh front fruit fully funny giant given glass globe glory grace grade grand
grant grass great green gross group grown guard guess guest guide happy harsh heart heavy
hence honey horse hotel house human humor ideal image imply index inner input issue joint
judge juice knife knock known label labor large laser later laugh layer learn lease least
leave legal lemon level light limit local logic loose lower lucky lunch magic major maker
march match maybe mayor meant media metal might minor minus mixed model money month moral
motor mount mouse mouth movie music naked nasty nerve never newly night noise north noted
novel nurse ocean offer often order other ought outer owner paint panel paper party peace
phase phone photo piano piece pilot pitch place plain plane plant plate point pound power
press price pride prime print prior prize proof proud prove queen quick quiet quite radio
raise range rapid ratio reach react ready refer relax reply right rival river robot rough
round route royal rural salad sauce scale scene scope score sense serve seven shade shake
shall shape share sharp sheep sheet shelf shell shift shine shirt shock shoot short shown
sight silly since sixth skill sleep slide small smart smile smoke solid solve sorry sound
south space spare speak speed spend spent spine split spoke sport staff stage stake stand
start state steam steel stick still stock stone stood store storm story strip stuck study
stuff style sugar suite super sweet table taken taste teach teeth thank theme there thick
thing think third those three threw throw tight timer tired title today topic total touch
tough tower track trade train treat trend trial tribe trick tried truck truly trust truth
twice uncle under union unity until upper upset urban usage usual valid value video virus
visit vital voice waste watch water wheel where which while white whole whose wider woman
women world worry worse worst worth would wound write wrong wrote yield young youth zebra""".split())
WORD_LENGTH = 5
GREEN, YELLOW, GRAY = "G", "Y", "-"
_WORD_SET = frozenset(WORDS)
_INDEX = {word: i for i, word in enumerate(WORDS)}


def score(guess: str, answer: str) -> str:
    """The feedback pattern for `guess` against `answer` (same length): G / Y / - per letter."""
    if len(guess) != len(answer):
        raise ValueError(f"guess {guess!r} and answer {answer!r} differ in length")
    pattern = [GRAY] * len(guess)
    unmatched = Counter()
    for i, (g, a) in enumerate(zip(guess, answer)):
        if g == a:
            pattern[i] = GREEN
        else:
            unmatched[a] += 1
    for i, g in enumerate(guess):
        if pattern[i] != GREEN and unmatched[g] > 0:
            pattern[i] = YELLOW
            unmatched[g] -= 1
    return "".join(pattern)


def answers(split: str = "train") -> list[str]:
    """The answers of a split, in `WORDS` order."""
    check_split(split)
    return [word for word in WORDS if split_of(f"wordle:{word}") == split]


def task_for_seed(seed: int, split: str = "train") -> dict[str, Any]:
    """The task seed `seed` gives in `split`."""
    rng = seeded_rng("wordle", split, seed)
    return {"answer": rng.choice(answers(split)), "max_guesses": 6, "partial_credit": False}


def tasks(split: str = "train", n: int | None = None) -> list[dict[str, Any]]:
    """Every answer of `split` once (n None), or the tasks of seeds 0..n-1."""
    if n is None:
        return [{"answer": word, "max_guesses": 6, "partial_credit": False} for word in answers(split)]
    return [task_for_seed(seed, split) for seed in range(n)]


def guess_error(guess: str) -> str:
    """Why a (normalized) guess is not allowed; empty when it is."""
    if len(guess) != WORD_LENGTH or not (guess.isascii() and guess.isalpha()):
        return f"{guess!r} is not a valid guess: it must be exactly {WORD_LENGTH} letters a-z"
    if guess not in _WORD_SET:
        return f"{guess!r} is not in the word list"
    return ""


def partial_score(pattern: str) -> float:
    return (pattern.count(GREEN) + 0.5 * pattern.count(YELLOW)) / len(pattern)


RULES = ("Guess the secret 5-letter English word in {n} tries. After each guess, each letter "
         "is marked G (right letter, right place), Y (in the word, but elsewhere) or - (not in "
         "the word, or no more copies of it). An invalid guess still uses a try. Reply with one "
         "5-letter word.")


class WordleAction(Action):
    guess: str = Field(description="a 5-letter English word")


class WordleObservation(Observation):
    text: str = Field(default="", description="what to show the model next")
    guesses: list[str] = Field(default_factory=list, description="valid guesses so far")
    patterns: list[str] = Field(default_factory=list, description="feedback per valid guess")
    guesses_left: int = Field(default=0, description="tries left")
    valid: bool = Field(default=True, description="whether the last guess was allowed")
    error: str = Field(default="", description="why the last guess was not allowed")
    solved: bool = Field(default=False, description="whether the word was found")
    answer: str = Field(default="", description="the secret word, once the episode has ended")


class WordleEnvironment(BundledEnvironment):
    NAME = "wordle"
    DESCRIPTION = "Guess a secret 5-letter word in 6 tries from green/yellow/gray feedback."

    task_for_seed = staticmethod(task_for_seed)

    def __init__(self, seed: int = 0, instance: int = 0):
        super().__init__(seed, instance)
        self._guesses: list[str] = []
        self._patterns: list[str] = []

    @classmethod
    def validate_task(cls, task: dict[str, Any]) -> dict[str, Any]:
        answer = task["answer"]
        if not isinstance(answer, str) or answer.strip().lower() not in _WORD_SET:
            raise ValueError(f"task field 'answer' must be a word of wordle.WORDS, got {answer!r}")
        return {"answer": answer.strip().lower(),
                "max_guesses": check_int(task, "max_guesses", 1, 10),
                "partial_credit": check_bool(task, "partial_credit")}

    def _observation(self, text: str, **kw: Any) -> WordleObservation:
        left = self._state.task["max_guesses"] - self._state.step_count
        return WordleObservation(text=text, guesses=list(self._guesses),
                                 patterns=list(self._patterns), guesses_left=left, **kw)

    def _begin(self, task: dict[str, Any]) -> WordleObservation:
        self._guesses, self._patterns = [], []
        return self._observation(RULES.format(n=task["max_guesses"]), done=False, reward=None)

    def _act(self, action: WordleAction) -> WordleObservation:
        task = self._state.task
        guess = action.guess.strip().lower()
        error = guess_error(guess)
        if not error:
            self._guesses.append(guess)
            self._patterns.append(score(guess, task["answer"]))
        solved = not error and guess == task["answer"]
        left = task["max_guesses"] - self._state.step_count
        done = solved or left <= 0
        if solved:
            reward, text = 1.0, f"{guess.upper()}: {self._patterns[-1]} Solved!"
        else:
            text = error or f"{guess.upper()}: {self._patterns[-1]}"
            text += f" ({left} {'try' if left == 1 else 'tries'} left)"
            reward = 0.0
            if done:
                text += f" Out of tries: the word was {task['answer'].upper()}."
                if task["partial_credit"] and self._patterns:
                    reward = 0.5 * max(map(partial_score, self._patterns))
        return self._observation(text, valid=not error, error=error, solved=solved, done=done,
                                 reward=reward, answer=task["answer"] if done else "")


# -- solver -------------------------------------------------------------------------------------

def _code(pattern: str) -> int:
    code = 0
    for mark in pattern:
        code = code * 3 + (2 if mark == GREEN else 1 if mark == YELLOW else 0)
    return code


@functools.lru_cache(maxsize=1)
def _table() -> tuple[tuple[int, ...], ...]:
    """_table()[g][a]: the feedback code of guess WORDS[g] against answer WORDS[a]."""
    return tuple(tuple(_code(score(g, a)) for a in WORDS) for g in WORDS)


def _best_guess(candidates: tuple[int, ...]) -> int:
    """The guess whose worst-case feedback leaves the fewest candidates (ties: expected size,
    then a candidate, then word order)."""
    if len(candidates) <= 2:
        return candidates[0]
    table, is_candidate = _table(), set(candidates)
    best, best_key = -1, None
    for g, row in enumerate(table):
        buckets = Counter(row[a] for a in candidates)
        key = (max(buckets.values()), sum(c * c for c in buckets.values()), g not in is_candidate, g)
        if best_key is None or key < best_key:
            best, best_key = g, key
    return best


@functools.lru_cache(maxsize=1)
def _first_guess() -> int:
    return _best_guess(tuple(range(len(WORDS))))


def candidates(guesses: Sequence[str], patterns: Sequence[str]) -> list[str]:
    """The words of `WORDS` consistent with every (guess, pattern) so far."""
    table = _table()
    rows = [(table[_INDEX[g]], _code(p)) for g, p in zip(guesses, patterns)]
    return [WORDS[a] for a in range(len(WORDS)) if all(row[a] == c for row, c in rows)]


def solve(history: Sequence[Any]) -> WordleAction:
    """The next guess, from the latest observation's guesses and patterns."""
    if not history:
        raise ValueError("wordle.solve needs at least reset's observation")
    last = as_dict(history[-1])
    guesses, patterns = last.get("guesses", []), last.get("patterns", [])
    if not guesses:
        return WordleAction(guess=WORDS[_first_guess()])
    left = candidates(guesses, patterns)
    if not left:
        raise ValueError("no word of wordle.WORDS fits this feedback")
    return WordleAction(guess=WORDS[_best_guess(tuple(_INDEX[w] for w in left))])


def demonstration(seed: int | None = None, split: str = "train", **task: Any) -> Episode:
    """One solver episode, played in-process."""
    return play(WordleEnvironment(), solve, seed=seed, split=split, **task)


SPEC = BundledEnv(
    name="wordle", description=WordleEnvironment.DESCRIPTION, env_cls=WordleEnvironment,
    action_cls=WordleAction, observation_cls=WordleObservation, task_for_seed=task_for_seed,
    tasks=tasks, solve=solve, demonstration=demonstration,
)
