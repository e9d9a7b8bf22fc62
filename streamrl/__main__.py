from streamrl.cli import main

raise SystemExit(main())
