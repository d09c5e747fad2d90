"""A user's classification task as a WHALE domain: which language a text is in, graded on the label exactly.

Use it with (from the repository root, so that `examples` is importable):

    PYTHONPATH=. whale eval --set domain.module=examples.language_domain:LanguageDomain --harness h0 --k 2
    PYTHONPATH=. whale run examples/language_domain.yaml --out runs/language-harness-only

It is the kind of task the harness search was never written for: its grader wants the label
alone ("French", as written), and its h0 asks the question the way a user would, so a small model
answers in a sentence ("This sentence is written in French.") and h0 scores 0. The domain
declares what its grader reads (`answer_format`, with the five `choices`); the offline proposer's
domain-general mechanisms act on that declaration. It also ships one hint of its own (`hints`),
the way any domain can carry knowledge for proposers; it is used only with
`harness.domain_hints: on` and shows as "hint: label_only_reminder".

Why five labels and not two: a harness that constrains the reply to the labels scores chance
without the model (a half with two labels), and the search's null-engine probe rightly refuses a
harness whose score the model does not beat; SmolLM2-135M told positive from negative reviews
barely above a half (0.526 [0.453, 0.599] mean@2 on 96 reviews, choices constrained), but names
these five languages well above a fifth.

Problems are a remark and a sentence in one language; the sentences (not the remarks) are dealt
to the splits, so no test sentence is seen on the harness split.
"""

from __future__ import annotations

import functools
import random

from whale.config import Config
from whale.domains.base import AnswerFormat, DataError, EpisodeEnv, Problem
from whale.harness.mechanism import Hints, Mutation, append_user_prompt

REMARKS = {
    "English": ["Good morning.", "Thank you very much.", "Excuse me.", "It is late.", "I am tired.", "See you soon.",
                "That is true.", "I am hungry."],
    "French": ["Bonjour.", "Merci beaucoup.", "Excusez-moi.", "Il est tard.", "Je suis fatigué.", "À bientôt.",
               "C'est vrai.", "J'ai faim."],
    "Spanish": ["Buenos días.", "Muchas gracias.", "Disculpe.", "Es tarde.", "Estoy cansado.", "Hasta pronto.",
                "Es verdad.", "Tengo hambre."],
    "German": ["Guten Morgen.", "Vielen Dank.", "Entschuldigung.", "Es ist spät.", "Ich bin müde.", "Bis bald.",
               "Das stimmt.", "Ich habe Hunger."],
    "Italian": ["Buongiorno.", "Grazie mille.", "Mi scusi.", "È tardi.", "Sono stanco.", "A presto.", "È vero.",
                "Ho fame."],
}
SENTENCES = {
    "English": ["The cat is sleeping on the sofa.", "We are going to the beach tomorrow.",
                "Where is the train station?",
                "My sister lives in a small town.", "The children are playing in the garden.",
                "I would like a cup of coffee.", "The weather is very nice today.", "We ate bread and cheese."],
    "French": ["Le chat dort sur le canapé.", "Nous allons à la plage demain.", "Où est la gare ?",
               "Ma sœur habite dans une petite ville.", "Les enfants jouent dans le jardin.",
               "Je voudrais une tasse de café.", "Il fait très beau aujourd'hui.",
               "Nous avons mangé du pain et du fromage."],
    "Spanish": ["El gato duerme en el sofá.", "Mañana vamos a la playa.", "¿Dónde está la estación de tren?",
                "Mi hermana vive en un pueblo pequeño.", "Los niños juegan en el jardín.", "Quisiera una taza de café.",
                "Hoy hace muy buen tiempo.", "Comimos pan y queso."],
    "German": ["Die Katze schläft auf dem Sofa.", "Wir fahren morgen an den Strand.", "Wo ist der Bahnhof?",
               "Meine Schwester wohnt in einer kleinen Stadt.", "Die Kinder spielen im Garten.",
               "Ich hätte gern eine Tasse Kaffee.", "Das Wetter ist heute sehr schön.",
               "Wir haben Brot und Käse gegessen."],
    "Italian": ["Il gatto dorme sul divano.", "Domani andiamo al mare.", "Dov'è la stazione?",
                "Mia sorella abita in un piccolo paese.", "I bambini giocano in giardino.",
                "Vorrei una tazza di caffè.",
                "Oggi fa molto bel tempo.", "Abbiamo mangiato pane e formaggio."],
}
LABELS = tuple(SENTENCES)
SENTENCE_SPLIT = {"test": (0, 1, 2), "val": (3,), "harness": (4, 5), "weight": (6, 7)}  # sentence indices

H0 = '''
SYSTEM_PROMPT = "You identify languages."
USER_PROMPT = "Text: {question}\\nWhich language is this text written in?"


def run(env, llm):
    out = llm([{"role": "system", "content": SYSTEM_PROMPT},
               {"role": "user", "content": USER_PROMPT.format(question=env.question)}], max_tokens=24)
    env.submit(str(out).strip())
'''


def grade_label(problem: Problem, answer: str | None) -> float:
    """1 when the submission is the gold label exactly (surrounding spaces aside), else 0."""
    return 1.0 if answer is not None and answer.strip() == problem.answer else 0.0


HINTS = Hints(
    mechanisms=(Mutation("label_only_reminder", "The model answers in sentences; asking for the language name "
                         "alone gets the label.", append_user_prompt("Answer with the language name only."),
                         prompt_only=True, fixes=("format_mismatch",), hint=True),),
    text="The texts are short and common; the grader wants the capitalised language name alone.")


class LanguageDomain:
    name = "languages"
    brief = ("Each episode is one short text, `env.question`, in English, French, Spanish, German or Italian. "
             "Submit its language with env.submit(label), once. Graded 1 when the submission is exactly the "
             "language's English name as written here (e.g. 'French'), else 0.")
    answer_format = AnswerFormat("the language name alone: English, French, Spanish, German or Italian",
                                 choices=LABELS)
    hints = HINTS

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def load_splits(self) -> dict[str, list[Problem]]:
        sizes = {"test": self.cfg.domain.splits.test, "val": self.cfg.domain.splits.val,
                 "harness": self.cfg.domain.splits.harness, "weight": self.cfg.domain.splits.weight}
        out: dict[str, list[Problem]] = {}
        for split, indices in SENTENCE_SPLIT.items():
            pool = [Problem(id=f"{lang[:2].lower()}-{j}-{i}", question=f"{remark} {SENTENCES[lang][j]}",
                            answer=lang, source=lang)
                    for lang in LABELS for j in indices for i, remark in enumerate(REMARKS[lang])]
            if sizes[split] > len(pool):
                raise DataError(f"languages: the {split} split holds at most {len(pool)} problems (asked "
                                f"{sizes[split]}); lower domain.splits.{split}")
            out[split] = random.Random(f"languages:{self.cfg.seed}:{split}").sample(pool, sizes[split])
        return out

    def make_env(self, problem: Problem) -> EpisodeEnv:
        return EpisodeEnv(problem)

    def grader(self):
        return functools.partial(grade_label)

    def grade(self, problem: Problem, answer: str | None) -> float:
        return grade_label(problem, answer)

    def base_harness(self) -> str:
        return H0
