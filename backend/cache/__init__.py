"""Cache memory: one page pool shared by MLA pages and KDA state sets, and the radix prefix cache."""
