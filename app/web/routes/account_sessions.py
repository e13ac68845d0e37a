"""The account page's sessions: "Sign out all other sessions" (the list itself is on the account
page, :mod:`app.web.routes.account`). The rule is :func:`app.studio.accounts.sign_out_others`."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse

from app.studio import accounts
from app.web import auth, flash
from app.web.auth import CurrentUser

router = APIRouter()


def ended_text(n: int) -> str:
    """The notice after signing out the others: ``"Signed out 2 other sessions."``."""
    if n == 0:
        return "There were no other sessions to sign out."
    return f"Signed out {n} other session{'s' if n != 1 else ''}."


@router.post("/account/sessions/sign-out-others")
def sign_out_others(request: Request, user: CurrentUser):
    """End every other session and access token of the caller (this one stays; API keys
    stay); back to the account page with the count (POST-redirect-GET)."""
    n = accounts.sign_out_others(request.app.state.engine, user, auth.current_token(request))
    flash.push(request, sessions_notice=ended_text(n))
    return RedirectResponse("/account#sessions", status_code=303)


@router.get("/account/sessions/sign-out-others", include_in_schema=False)
def sign_out_others_get(user: CurrentUser):
    """The form's URL opened directly (reload, address bar): the account page, nothing ended."""
    return RedirectResponse("/account#sessions", status_code=303)
