"""A real stdio MCP server (the SDK's MCPServer) for a library catalogue, in a librarian's terms
(MARC records, call numbers, holds, interlibrary loans): `python tests/support/library_server.py`.

It is the server of issue 40: the embedded 135M generator cannot write tasks for tools like
these (it writes "translate languages" or "help law enforcement"), so `art mcp-train
--generator embedded` must give up after one attempt with a one-line error naming the way out.
The catalogue is a few records in memory; each process starts from the same state."""

from __future__ import annotations

from typing import Any

RECORDS = {  # control number -> (title, author, call number, copies on the shelf)
    "ocm00012345": ("The Left Hand of Darkness", "Le Guin, Ursula K.", "PS3562.E42 L4", 2),
    "ocm00067890": ("Dune", "Herbert, Frank", "PS3558.E63 D8", 0),
    "ocm00011111": ("Invisible Cities", "Calvino, Italo", "PQ4809.A45 C513", 1),
}
BRANCHES = ("central", "riverside", "hillcrest")


def build() -> Any:  # -> MCPServer
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer("library", instructions="A library catalogue: MARC records, holds, "
                       "circulation and interlibrary loan.", log_level="WARNING")
    holds: list[tuple[str, str]] = []

    def record(control_number: str) -> tuple[str, str, str, int]:
        if control_number not in RECORDS:
            raise ToolError(f"no MARC record {control_number!r}")
        return RECORDS[control_number]

    @server.tool()
    def marc_lookup(control_number: str) -> str:
        """Fetch the MARC 245/100/050 fields of a bibliographic record by its 001 control
        number."""
        title, author, call, _ = record(control_number)
        return f"245 {title}\n100 {author}\n050 {call}"

    @server.tool()
    def z3950_search(cql: str) -> list[str]:
        """Run a CQL query (e.g. dc.creator=Calvino) against the union catalogue over Z39.50;
        gives the 001 control numbers that match."""
        words = cql.lower().replace("=", " ").split()
        return [n for n, (title, author, _, _) in RECORDS.items()
                if any(w in f"{title} {author}".lower() for w in words if len(w) > 3)]

    @server.tool()
    def place_hold(control_number: str, patron_barcode: str, pickup_branch: str) -> str:
        """Queue a title-level hold for a patron, to be trapped at the pickup branch."""
        record(control_number)
        if pickup_branch not in BRANCHES:
            raise ToolError(f"pickup_branch must be one of {', '.join(BRANCHES)}")
        holds.append((control_number, patron_barcode))
        queue = sum(1 for n, _ in holds if n == control_number)
        return f"hold placed: position {queue} in the queue"

    @server.tool()
    def ill_request(control_number: str, lending_symbol: str) -> str:
        """File an interlibrary loan request (ISO 10161) with the lending library's OCLC
        symbol when no copy is on the shelf."""
        _, _, _, copies = record(control_number)
        if copies:
            raise ToolError(f"{copies} copies on the shelf: no ILL needed")
        return f"ILL request sent to {lending_symbol.upper()}"

    return server


if __name__ == "__main__":
    build().run()
