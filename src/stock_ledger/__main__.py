import sys

from stock_ledger.entry import main

sys.exit(main())
