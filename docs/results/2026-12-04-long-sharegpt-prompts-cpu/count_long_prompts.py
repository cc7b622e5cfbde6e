import collections
from dflash.data.prompts import load_prompts
from dflash.models.targets import load_target
t = load_target("smollm2")
ps = load_prompts("sharegpt", turns="all")
print(len(ps))
tok = t.tokenizer
over = collections.Counter(); total = collections.Counter(); first_long = 0
lens = []
for p in ps:
    turn = sum(m["role"] == "user" for m in p.messages)
    n = len(tok(tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"])
    total[min(turn, 5)] += 1
    if n > 1023:
        over[min(turn, 5)] += 1
        m = len(tok(tok.apply_chat_template([p.messages[-1]], add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"])
        if m <= 1023 - 128: first_long += 1
print("turn: total / over 1023", {k: (total[k], over[k]) for k in sorted(total)})
print("over-long prompts whose last user turn alone fits with 128 tokens of answer room:", first_long)
