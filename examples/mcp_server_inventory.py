"""A small, real MCP server: a stock room kept in SQLite, with five tools.

Run it over stdio (how `art mcp-train -- python examples/mcp_server_inventory.py` starts it) or
over streamable HTTP:

    python examples/mcp_server_inventory.py                     # stdio
    python examples/mcp_server_inventory.py --http --port 8765  # http://127.0.0.1:8765/mcp

Where the database lives: `--db PATH`, else `$INVENTORY_DB`, else `inventory.db` in
`$ART_MCP_ROLLOUT_DIR` (the fresh directory `art_mcp` gives each rollout's server, so rollouts
never see each other's changes), else in the current directory. A new database is filled with
`STOCK`.

The outcome of a task can be read back from the database, so a reward can be verified instead of
judged: `verify(scenario, db_path)` compares the stock with the scenario's `expected` state, and
`reward(trajectory, context)` (that check, and the agent saying it is done) is in the form
`art_mcp.train_mcp(reward=...)` takes.
The scenarios in `examples/data/inventory_scenarios.jsonl` carry `expected`.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
from pathlib import Path
from typing import Any, Literal

STOCK = [  # item, quantity, shelf
    ("pen", 40, "A1"), ("notebook", 12, "A2"), ("stapler", 5, "B1"), ("tape", 0, "B2"),
    ("marker", 25, "C1"), ("folder", 8, "C2"), ("scissors", 3, "D1"), ("glue", 15, "D2"),
]


def db_path(explicit: str | None = None) -> Path:
    """The database this server uses (see the module docstring for the order)."""
    if explicit:
        return Path(explicit)
    if os.environ.get("INVENTORY_DB"):
        return Path(os.environ["INVENTORY_DB"])
    return Path(os.environ.get("ART_MCP_ROLLOUT_DIR", ".")) / "inventory.db"


def open_db(path: Path) -> sqlite3.Connection:
    """Open the database, creating and filling it with `STOCK` if it is new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, isolation_level=None)  # autocommit: each tool call is durable
    conn.execute("CREATE TABLE IF NOT EXISTS items "
                 "(name TEXT PRIMARY KEY, quantity INTEGER NOT NULL, shelf TEXT NOT NULL)")
    if conn.execute("SELECT COUNT(*) FROM items").fetchone()[0] == 0:
        conn.executemany("INSERT INTO items VALUES (?, ?, ?)", STOCK)
    return conn


def read_stock(path: Path) -> dict[str, dict[str, Any]]:
    """{item: {"quantity": n, "shelf": s}} as stored now."""
    conn = open_db(path)
    try:
        rows = conn.execute("SELECT name, quantity, shelf FROM items").fetchall()
    finally:
        conn.close()
    return {n: {"quantity": q, "shelf": s} for n, q, s in rows}


Item = Literal["pen", "notebook", "stapler", "tape", "marker", "folder", "scissors", "glue"]
"""The items, as an enum in the tools' schemas: a client (or a small model held to the schema)
can only name one that exists."""


def build_server(path: Path) -> Any:
    """The MCP server over the database at `path`."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError  # is_error result, message kept

    conn = open_db(path)
    server = MCPServer("inventory", instructions="A stock room: look up, add, remove and move items.",
                       log_level="WARNING")

    def _row(item: str) -> tuple[str, int, str]:
        key = " ".join(item.lower().split())
        # forgiving like a clerk: "Pens", "the pen", "pen " all mean the pen
        keys = [key, key.removeprefix("the "), key.rstrip("s"), key.removeprefix("the ").rstrip("s")]
        row = None
        for k in keys:
            row = row or conn.execute("SELECT name, quantity, shelf FROM items WHERE name = ?",
                                      (k,)).fetchone()
        if row is None:
            known = ", ".join(r[0] for r in conn.execute("SELECT name FROM items ORDER BY name"))
            raise ToolError(f"no item named {item!r}; items: {known}")
        return row

    def _positive(quantity: int) -> int:
        if quantity <= 0:
            raise ToolError(f"quantity must be a positive number, got {quantity}")
        return quantity

    @server.tool()
    async def list_items() -> str:
        """List every item with its quantity and shelf."""
        rows = conn.execute("SELECT name, quantity, shelf FROM items ORDER BY name").fetchall()
        return "\n".join(f"{n}: {q} on shelf {s}" for n, q, s in rows)

    @server.tool()
    async def look_up(item: Item) -> str:
        """Show how many of an item are in stock and on which shelf."""
        name, quantity, shelf = _row(item)
        return f"{name}: {quantity} on shelf {shelf}"

    @server.tool()
    async def add_stock(item: Item, quantity: int) -> str:
        """Add units of an item to the stock (a delivery arrived)."""
        name, have, _ = _row(item)
        conn.execute("UPDATE items SET quantity = ? WHERE name = ?",
                     (have + _positive(quantity), name))
        return f"{name}: {have} -> {have + quantity}"

    @server.tool()
    async def remove_stock(item: Item, quantity: int) -> str:
        """Take units of an item out of the stock (sold or used)."""
        name, have, _ = _row(item)
        if _positive(quantity) > have:
            raise ToolError(f"only {have} {name} in stock, cannot remove {quantity}")
        conn.execute("UPDATE items SET quantity = ? WHERE name = ?", (have - quantity, name))
        return f"{name}: {have} -> {have - quantity}"

    @server.tool()
    async def move_item(item: Item, shelf: str) -> str:
        """Move an item to another shelf."""
        name, _, old = _row(item)
        new = shelf.strip().upper()
        if not new:
            raise ToolError("shelf must not be empty")
        conn.execute("UPDATE items SET shelf = ? WHERE name = ?", (new, name))
        return f"{name}: shelf {old} -> {new}"

    return server


def verify(scenario: dict[str, Any], path: Path) -> float:
    """1.0 when every expected fact holds and nothing else changed (solved). Short of that,
    partial credit, so a small model's first steps carry signal: per expected fact 1 if it
    holds, 0.5 if the right field of the right item moved the right way (wrong amount or
    shelf), else 0, averaged; and 0 outright when an item that should stay changed."""
    expected: dict[str, dict[str, Any]] = scenario.get("expected") or {}
    stock = read_stock(path)
    initial = {n: {"quantity": q, "shelf": s} for n, q, s in STOCK}
    for name, now in stock.items():
        if name not in expected and now != initial.get(name):
            return 0.0
    scores = []
    for name, want in expected.items():
        for key, value in want.items():
            got, was = stock.get(name, {}).get(key), initial.get(name, {}).get(key)
            if key == "quantity":
                right_way = got != was and (got - was) * (value - was) > 0
            else:
                right_way = got != was
            scores.append(1.0 if got == value else 0.5 if right_way else 0.0)
    return sum(scores) / len(scores) if scores else 1.0


def reward(trajectory: Any, context: Any) -> float:
    """`art_mcp` reward: 1.0 when the agent left the stock exactly as the task asks and then
    said it was done (`complete_task`); otherwise 0.3 x the partial credit of `verify`.

    Why completion counts: with the stock alone as the reward, the agent learned never to call
    `complete_task` (held-out completion 0.88 -> 0.29 in 4 steps) because calling it early was
    the base model's common mistake, and more tool calls never cost anything."""
    score = verify(context.scenario.model_dump(), Path(context.workdir) / "inventory.db")
    if score >= 1.0 and trajectory.metrics.get("completed"):
        return 1.0
    return 0.3 * score


def turn_reward(trajectory: Any, context: Any, turn: int) -> float:
    """`art_mcp` reward per turn (`train_mcp(turn_reward=...)`): the progress turn `turn` made,
    0.3 x (`verify` of the stock after its calls - before them), read from the rollout's own
    database. The turns' rewards add up to 0.3 x the final partial credit, so `reward`'s
    completion bonus (the rest of a solved episode's 1.0) goes to the last turn; a turn that
    breaks what an earlier one got right is paid negative (shaping by a potential, so the
    episode's return is unchanged)."""
    score = verify(context.scenario.model_dump(), Path(context.workdir) / "inventory.db")
    earlier = sum(r or 0.0 for r in trajectory.turn_rewards[:turn])
    return 0.3 * score - earlier


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", help="database file (default: see the module docstring)")
    p.add_argument("--http", action="store_true", help="serve streamable HTTP, not stdio")
    p.add_argument("--port", type=int, default=8765)
    args = p.parse_args()
    server = build_server(db_path(args.db))
    if args.http:
        server.run("streamable-http", host="127.0.0.1", port=args.port)
    else:
        server.run("stdio")


if __name__ == "__main__":
    main()
