"""Search QA hint blocks (harness code the domain's hints splice in, see hints.py):
what is retrieved, how the query is written, how many turns, how the answer ends."""

MORE_PASSAGES = r'''
MP_PASSAGES = 3
MP_WORDS = 60


class _MorePassagesEnv:
    """env whose search gives the top MP_PASSAGES passages (shortened, merged) where one is asked for."""

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        return getattr(self._env, name)

    def search(self, query, k=3):
        results = self._env.search(query, k=max(int(k), MP_PASSAGES))
        if int(k) > 1 or len(results) <= 1:
            return results
        top = results[:MP_PASSAGES]
        text = " ".join("(" + str(r["title"]) + ") " + " ".join(str(r["text"]).split()[:MP_WORDS]) for r in top)
        return [{"title": " / ".join(str(r["title"]) for r in top), "text": text}]


def run(env, llm):
    return __INNER__(_MorePassagesEnv(env), llm)
'''

QUERY_REWRITE = r'''
QR_STOPWORDS = {"what", "which", "who", "whom", "whose", "where", "when", "why", "how", "is", "are", "was",
                "were", "the", "a", "an", "of", "does", "do", "did", "in", "for", "to", "and", "please"}


class _QueryRewriteEnv:
    """env whose search drops question words and punctuation from the query (BM25 wants content words)."""

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        return getattr(self._env, name)

    def search(self, query, k=3):
        words = re.findall(r"[\w'-]+", str(query))
        kept = [w for w in words if w.lower() not in QR_STOPWORDS]
        return self._env.search(" ".join(kept) or str(query), k=k)


def run(env, llm):
    return __INNER__(_QueryRewriteEnv(env), llm)
'''

FORCE_RETRIEVAL = r'''
FR_PASSAGES = 2
FR_WORDS = 60


def run(env, llm):
    cache = {}

    def llm_with_evidence(messages, **kw):
        if "text" not in cache:
            try:
                results = env.search(env.question, k=FR_PASSAGES)
            except Exception:
                results = []
            cache["text"] = "\n".join("(" + str(r["title"]) + ") " + " ".join(str(r["text"]).split()[:FR_WORDS])
                                      for r in results)
        if cache["text"]:
            messages = _mut_add_to_user(messages, "Retrieved for this question:\n" + cache["text"], first=True)
        return llm(messages, **kw)

    return __INNER__(env, llm_with_evidence)
'''

RETRIEVED_TITLES = r'''
class _TitlesEnv:
    """env that remembers the titles of every passage its search returned."""

    def __init__(self, env, titles):
        self._env = env
        self._titles = titles

    def __getattr__(self, name):
        return getattr(self._env, name)

    def search(self, query, k=3):
        results = self._env.search(query, k=k)
        for r in results:
            title = str(r.get("title", ""))
            if title and title not in self._titles:
                self._titles.append(title)
        return results


def run(env, llm):
    titles = []

    def llm_with_titles(messages, **kw):
        if titles:
            messages = _mut_add_to_user(messages, "Titles retrieved so far: " + "; ".join(titles[-8:]))
        return llm(messages, **kw)

    return __INNER__(_TitlesEnv(env, titles), llm_with_titles)
'''

SEARCH_TURNS_RUN = r'''
MST_TURNS = 3


def __NAME__(env, llm):
    words = globals().get("MAX_PASSAGE_WORDS", 200)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if SYSTEM_PROMPT else []
    messages.append({"role": "user", "content": USER_PROMPT.format(question=env.question)})
    for _ in range(MST_TURNS):
        reply = str(llm(messages, max_tokens=128, stop=["</search>", "</answer>"]))
        s_pos, a_pos = reply.find("<search>"), reply.find("<answer>")
        if a_pos >= 0 and (s_pos < 0 or a_pos < s_pos):
            m = re.search(r"<answer>(.*?)(?:</answer>|$)", reply, re.S)
            env.submit("<answer>" + m.group(1).strip() + "</answer>")
            return
        m = re.search(r"<search>(.*?)(?:</search>|$)", reply, re.S) if s_pos >= 0 else None
        query = m.group(1).strip().splitlines()[0].strip() if m and m.group(1).strip() else ""
        if not query:
            messages.append({"role": "assistant", "content": (reply.rstrip() + "\n<answer>").lstrip()})
            break
        results = env.search(query, k=1)
        passage = "no results"
        if results:
            passage = " ".join((str(results[0]["title"]) + "\n" + str(results[0]["text"])).split(" ")[:words])
        messages += [
            {"role": "assistant", "content": reply[:s_pos] + "<search>" + query + "</search>"},
            {"role": "user", "content": "<information>" + passage + "</information>\nIf a fact is still missing, "
             "search again with <search>query</search>; otherwise answer inside <answer></answer>."},
        ]
    else:
        messages.append({"role": "assistant", "content": "<answer>"})
    final = str(llm(messages, max_tokens=32, stop=["</answer>"]))
    env.submit("<answer>" + final.split("</answer>")[0].strip() + "</answer>")
'''

SEARCHQA_REMINDER = "Reply with only the short answer (a name, place or number), never a sentence."


QUESTION_AS_QUERY = r'''
class _QuestionQueryEnv:
    """env whose search uses the question itself as the query (the model's own query is dropped)."""

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        return getattr(self._env, name)

    def search(self, query, k=3):
        return self._env.search(self._env.question, k=k)


def run(env, llm):
    return __INNER__(_QuestionQueryEnv(env), llm)
'''

