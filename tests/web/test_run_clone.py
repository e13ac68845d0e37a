"""Clone a run into the new-run form (issue 16): the form opens with the run's settings (the
SFT or the GRPO form as the run's kind says), the settings the form does not show ride along as
hidden inputs, and submitting it as it is starts a run with the same spec; an edit changes only
that field. Another user's run is a 404."""
from __future__ import annotations

from html.parser import HTMLParser

from app.store import repo
from app.store.schema import Dataset
from app.studio import accounts
from tests.conftest import SHARED_DATA as SHARED
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER, signed_in, upload_sft

GSM8K = SHARED / "grpo" / "gsm8k" / "train.jsonl"


class _Form(HTMLParser):
    """The fields a browser would submit from the form with id ``form_id``: inputs (checked
    checkboxes only), selected options, textareas (multi-valued as a list of pairs)."""

    def __init__(self, form_id: str):
        super().__init__()
        self.form_id, self.inside, self.fields = form_id, False, []
        self._select = self._textarea = self._option = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "form":
            self.inside = a.get("id") == self.form_id
        if not self.inside:
            return
        if tag == "input" and a.get("name") and (a.get("type") not in ("checkbox", "radio")
                                                 or "checked" in a):
            self.fields.append((a["name"], a.get("value") or ""))
        elif tag == "select":
            self._select = a.get("name")
        elif tag == "option" and self._select and "selected" in a:
            self._option = [self._select, a.get("value")]  # no value: the option's text
        elif tag == "textarea":
            self._textarea = [a.get("name"), ""]

    def handle_data(self, data):
        if self._textarea is not None:
            self._textarea[1] += data
        if self._option is not None and self._option[1] is None:
            self._option[1] = data.strip()

    def handle_endtag(self, tag):
        if tag == "form":
            self.inside = False
        elif tag == "select":
            self._select = None
        elif tag == "option" and self._option is not None:
            self.fields.append((self._option[0], self._option[1] or ""))
            self._option = None
        elif tag == "textarea" and self._textarea is not None:
            self.fields.append(tuple(self._textarea))
            self._textarea = None


def _form_fields(html: str, form_id: str) -> list[tuple[str, str]]:
    import html as html_mod

    p = _Form(form_id)
    p.feed(html)
    return [(k, html_mod.unescape(v)) for k, v in p.fields]


def _submit(client, url: str, fields: list[tuple[str, str]], **changes) -> dict:
    from urllib.parse import urlencode

    body = urlencode([(k, changes.get(k, v)) for k, v in fields])
    r = client.post(url, content=body, follow_redirects=False,
                    headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 303, r.text[:3000]
    return repo.get_run(client.app.state.engine, r.headers["location"].rsplit("/", 1)[1])


def test_clone_an_sft_run(app, client, engine):
    ds = upload_sft(client)
    body = {"model": "stories260K", "dataset": ds, "name": "first try", "r": 4, "lora_alpha": 8,
            "learning_rate": 3e-4, "max_steps": 7, "weight_decay": 0.05, "max_grad_norm": 0.5,
            "logging_steps": 2, "use_rslora": True, "target_modules": ["q_proj", "o_proj"],
            "chat_template": "alpaca", "validation_split_percentage": 10, "eval_steps": 3,
            "train_on_responses_only": False, "seed": 9}
    r = client.post("/api/runs", json=body)
    assert r.status_code == 201, r.text
    src = repo.get_run(engine, r.json()["id"])
    page = client.get(f"/runs/{src.id}").text
    assert f'href="/runs/new?clone={src.id}"' in page

    form = client.get(f"/runs/new?clone={src.id}").text
    assert f"Cloned from run <a href=\"/runs/{src.id}\">{src.id}</a>" in form
    fields = dict(_form_fields(form, "run_form"))
    assert fields["name"] == "first try (copy)" and fields["r"] == "4"
    assert fields["learning_rate"] == "0.0003" and fields["chat_template_choice"] == "alpaca"
    assert fields["weight_decay"] == "0.05" and fields["use_rslora"] == "true"  # hidden inputs
    assert "weight_decay=0.05" in form and "max_grad_norm=0.5" in form  # and listed

    same = _submit(client, "/runs", _form_fields(form, "run_form"))
    assert same.id != src.id and same.name == "first try (copy)"
    assert same.spec == src.spec
    edited = _submit(client, "/runs", _form_fields(form, "run_form"), r="16")
    assert {k for k in src.spec if edited.spec[k] != src.spec[k]} == {"r"}

    admin = accounts.authenticate(engine, ADMIN_USER, ADMIN_PASSWORD)
    accounts.create_user(engine, "bea", "bea-password-1", actor=admin)
    with signed_in(app, "bea", "bea-password-1") as bea:
        assert bea.get(f"/runs/new?clone={src.id}").status_code == 404
        assert bea.get(f"/runs/new/grpo?clone={src.id}").status_code == 404


def test_clone_a_grpo_run(client, engine):
    admin = accounts.authenticate(engine, ADMIN_USER, ADMIN_PASSWORD)
    ds = repo.add_dataset(engine, Dataset(filename="gsm8k_train.jsonl", path=str(GSM8K),
                                          rows=7473, format="prompts", owner=admin.id))
    body = {"model": "stories260K", "dataset": ds.id, "name": "gsm8k", "num_generations": 4,
            "max_completion_length": 64, "beta": 0.02, "weight_decay": 0.01, "max_steps": 5,
            "rewards": [{"name": "numeric_match", "weight": 2.0},
                        {"name": "format", "weight": 0.25},
                        {"name": "length_penalty", "weight": 0.1,
                         "params": {"target_tokens": 40}}]}
    r = client.post("/api/runs/grpo", json=body)
    assert r.status_code == 201, r.text
    src = repo.get_run(engine, r.json()["id"])
    assert f'href="/runs/new/grpo?clone={src.id}"' in client.get(f"/runs/{src.id}").text
    r = client.get(f"/runs/new?clone={src.id}", follow_redirects=False)  # the SFT form's link
    assert r.status_code == 303 and r.headers["location"] == f"/runs/new/grpo?clone={src.id}"

    form = client.get(f"/runs/new/grpo?clone={src.id}").text
    fields = _form_fields(form, "grpo_form")
    d = dict(fields)
    assert sorted(v for k, v in fields if k == "rewards") == ["format", "length_penalty",
                                                              "numeric_match"]
    assert d["weight_numeric_match"] == "2.0" and d["target_tokens"] == "40"
    assert d["beta"] == "0.02" and d["weight_decay"] == "0.01"
    same = _submit(client, "/runs/grpo", fields)
    assert same.kind == "grpo" and same.spec == src.spec
